
import pytest
import torch

# One thread in the test process too: forked ranks inherit a clean pool, and timings do not fight.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """A small stdlib byte corpus cached once per session, shared by every test and rank."""
    path = tmp_path_factory.mktemp("corpus")
    return str(path)

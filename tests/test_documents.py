"""Documents of a packed window (bigtrain/core/documents.py): hand-written windows, each answer
written out by hand from the rule in the module's doc string."""

import pytest
import torch

from bigtrain.core.documents import (DocumentBoundaries, document_ids, document_mask, document_positions,
                                     document_starts)

END, BOS = 0, 1
ENDS = DocumentBoundaries(ends=(END,))
BOTH = DocumentBoundaries(starts=(BOS,), ends=(END,))


def ids(row, b=ENDS):
    return document_ids(torch.tensor([row]), b)[0].tolist()


def positions(row, b=ENDS):
    return document_positions(torch.tensor([row]), b)[0].tolist()


def test_end_token_belongs_to_the_document_it_ends():
    assert ids([5, 6, END, 7, 8, END, 9]) == [0, 0, 0, 1, 1, 1, 2]
    assert positions([5, 6, END, 7, 8, END, 9]) == [0, 1, 2, 0, 1, 2, 0]


def test_documents_of_length_one():
    # consecutive end tokens: each is a document of one token (an empty document's end)
    assert ids([END, END, END, 4]) == [0, 1, 2, 3]
    assert positions([END, END, END, 4]) == [0, 0, 0, 0]


def test_window_starting_mid_document():
    # the window's first tokens are the tail of a document cut off before it: document 0, positions from 0
    assert ids([7, 8, 9, END, 3, 4]) == [0, 0, 0, 0, 1, 1]
    assert positions([7, 8, 9, END, 3, 4]) == [0, 1, 2, 3, 0, 1]


def test_window_that_is_one_document():
    assert ids([3, 4, 5, 6]) == [0, 0, 0, 0]
    assert positions([3, 4, 5, 6]) == [0, 1, 2, 3]
    assert document_mask(torch.tensor([[3, 4, 5, 6]]) * 0)[0, 0].equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_separator_as_last_token():
    # the end token closes the last document; the one after it would begin outside the window
    assert ids([3, 4, END, 5, END]) == [0, 0, 0, 1, 1]
    assert positions([3, 4, END, 5, END]) == [0, 1, 2, 0, 1]


def test_start_tokens_and_end_then_start_is_one_boundary():
    row = [BOS, 3, END, BOS, 4, 5, BOS, 6]
    assert ids(row, BOTH) == [0, 0, 0, 1, 1, 1, 2, 2]
    assert positions(row, BOTH) == [0, 1, 2, 0, 1, 2, 0, 1]
    assert ids([3, BOS, 4], DocumentBoundaries(starts=(BOS,))) == [0, 1, 1]
    assert ids([BOS, 3], DocumentBoundaries(starts=(BOS,))) == [0, 0]


def test_rows_are_independent_and_first_token_always_starts():
    tokens = torch.tensor([[END, 3, 4], [3, END, 4]])
    assert document_starts(tokens, ENDS).tolist() == [[True, True, False], [True, False, True]]
    assert document_ids(tokens, ENDS).tolist() == [[0, 1, 1], [0, 0, 1]]


def test_mask_written_out():
    docs = torch.tensor([[0, 0, 1, 1, 1]])
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert document_mask(docs)[0, 0].equal(expected)
    windowed = expected.clone()
    windowed[4, 2] = False  # window 2: key j > i - 2
    assert document_mask(docs, window=2)[0, 0].equal(windowed)
    assert document_mask(docs).shape == (1, 1, 5, 5)


def test_boundaries_need_a_token():
    with pytest.raises(ValueError, match="data.document_end"):
        DocumentBoundaries()

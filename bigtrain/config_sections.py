"""The sections of the typed config: one dataclass per ``[section]`` of a TOML file, every field
with its help text in ``metadata["doc"]`` (:func:`doc`), which the CLI, the docs and error messages
all read.

:class:`bigtrain.config.Config` is the tree of these sections; import them from
:mod:`bigtrain.config`, the config's documented entry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def doc(text: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A dataclass field with its help text."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text}, **kw)


@dataclass
class ModelConfig:
    """The model: its family, and the reference Llama-style decoder's fields."""

    family: str = doc("Model family (bigtrain/families): 'llama' (the decoder), 'dlrm' (a recommender: bottom MLP, "
                      "the [embedding] tables, dot interaction, top MLP, binary cross-entropy) or 'hf' (a Hugging "
                      "Face Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE from model.hf_config). model.name is "
                      "its older spelling, still read. Or a family of one's own, which model.family_module "
                      "registers.", "llama")
    family_module: str = doc("A module of one's own to import before the config is validated, in the launcher and "
                             "in every rank, as a dotted import path ('my_models.gpt2', importable from the working "
                             "directory or sys.path): it calls bigtrain.families.register_family, so that "
                             "model.family can name the family it registers (docs/families.md). '' for none.", "")
    hf_config: str = doc("model.family = 'hf': a local config.json (or the folder holding one) of a LlamaForCausalLM, "
                         "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, "
                         "Qwen2MoeForCausalLM or Qwen3MoeForCausalLM; no hub access.", "")
    vocab_size: int = doc("Vocabulary size; 256 for the byte-level corpora.", 256)
    dim: int = doc("Hidden size h.", 128)
    n_layers: int = doc("Number of transformer blocks L.", 4)
    n_heads: int = doc("Attention (query) heads.", 4)
    n_kv_heads: int = doc("Key/value heads for grouped-query attention; 0 means n_heads.", 0)
    ffn_hidden: int = doc("SwiGLU inner size; 0 means 8/3 h rounded up to a multiple of 64.", 0)
    max_seq_len: int = doc("Longest sequence the rotary tables cover.", 256)
    rope_theta: float = doc("Rotary embedding base.", 10000.0)
    norm_eps: float = doc("RMSNorm epsilon.", 1e-5)
    tie_embeddings: bool = doc("Share the input embedding with the output projection.", False)
    init_std: float = doc("Standard deviation of the normal weight init.", 0.02)
    attention_head_dim: int = doc("Size of each attention head (q, k, v rows per head); 0 means dim / n_heads. "
                                  "Models such as Qwen3 and Gemma set it apart from dim / n_heads.", 0)
    attention_bias: bool = doc("Biases on the q, k, v and output projections (Hugging Face Llama's "
                               "attention_bias).", False)
    qkv_bias: bool = doc("Biases on the q, k and v projections only (Qwen2).", False)
    mlp_bias: bool = doc("Biases on the three SwiGLU projections (Hugging Face Llama's mlp_bias); dense models "
                         "only (the experts have none: refused with model.moe_experts > 0).", False)
    qk_norm: bool = doc("An RMSNorm over each query and key head before the rotary embedding (Qwen3's q_norm "
                        "and k_norm). Set by the Hugging Face family from its config.json, for the planner's "
                        "pricing; bigtrain's Llama does not build it.", False)
    rope_scaling: str = doc("Rotary frequency scaling for contexts past the trained one: 'none', 'linear' "
                            "(every frequency / rope_factor), 'llama3' (Llama 3.1: low frequencies / rope_factor, "
                            "high ones kept, blended between) or 'yarn' (YaRN: blended over rope_beta_fast .. "
                            "rope_beta_slow rotations, cos and sin x rope_attention_factor).", "none")
    rope_factor: float = doc("rope_scaling: the context extension factor (Llama 3.1: 8).", 1.0)
    rope_original_max_len: int = doc("rope_scaling 'llama3' / 'yarn': the context length before scaling "
                                     "(original_max_position_embeddings; 'yarn': 0 means max_seq_len).", 0)
    rope_low_freq_factor: float = doc("rope_scaling 'llama3': low_freq_factor (Llama 3.1: 1).", 1.0)
    rope_high_freq_factor: float = doc("rope_scaling 'llama3': high_freq_factor (Llama 3.1: 4).", 4.0)
    rope_beta_fast: float = doc("rope_scaling 'yarn': beta_fast, rotations where interpolation ends.", 32.0)
    rope_beta_slow: float = doc("rope_scaling 'yarn': beta_slow, rotations where it is complete.", 1.0)
    rope_attention_factor: float = doc("rope_scaling 'yarn': the factor on cos and sin; 0 means "
                                       "0.1 ln(rope_factor) + 1.", 0.0)
    init_from: str = doc("Start from existing weights instead of a random init: 'hf:PATH', a local Hugging Face "
                         "folder (config.json, *.safetensors; `bigtrain export --format hf` writes one). "
                         "model.family = 'llama': `bigtrain train` takes the [model] shape from its config.json; "
                         "'hf': model.hf_config must describe the same model. '' for a random init.", "")
    moe_experts: int = doc("Mixture of experts: experts E per MoE block; 0 keeps every block dense.", 0)
    moe_top_k: int = doc("MoE: experts each token is routed to (1 = Switch, 2 = Mixtral); <= moe_experts.", 2)
    moe_every: int = doc("MoE: every k-th block is an MoE block (blocks k-1, 2k-1, ...; 1 = all of them).", 1)
    moe_capacity_factor: float = doc("MoE: capacity per expert and sequence = ceil(factor x seq x top_k / E); "
                                     "routings past it are dropped (first choices before second ones, earlier "
                                     "tokens first). 0 = dropless.", 0.0)
    moe_aux_loss_coef: float = doc("MoE: weight of the Switch load-balancing loss E sum_e f_e P_e, computed per "
                                   "sequence and averaged over the global batch (router 'softmax' only).", 0.01)
    moe_router: str = doc("MoE router: 'softmax' (top-k of softmax scores, aux loss) or 'sigmoid-bias' "
                          "(aux-loss-free: a per-expert bias, updated outside the gradient after each step, "
                          "steers selection towards under-loaded experts).", "softmax")
    moe_ffn_hidden: int = doc("MoE: each expert's SwiGLU inner size; 0 means the dense ffn size.", 0)
    moe_shared_expert: bool = doc("MoE: add a dense shared expert (a SwiGLU of the expert size) every token goes "
                                  "through.", False)
    moe_dense_layers: str = doc("MoE: blocks kept dense whatever moe_every says, as indices from 0 like '0,1' "
                                "(Qwen-MoE's mlp_only_layers; DeepSeek's first dense blocks); '' for none.", "")
    moe_shared_expert_hidden: int = doc("MoE: the shared expert's SwiGLU inner size; 0 means the expert size "
                                        "(Qwen2-MoE's shared_expert_intermediate_size).", 0)
    moe_shared_expert_gate: bool = doc("MoE: scale the shared expert's output per token by sigmoid(w x), w one "
                                       "learned row (Qwen2-MoE's shared_expert_gate).", False)
    attn_mask: str = doc("'causal' (each token attends to every earlier token of its window) or 'block_causal' "
                         "(to the earlier tokens of its own document only: torchtitan's block_causal, Megatron's "
                         "reset_attention_mask). Documents are found from the window's token ids: the token after "
                         "an end token (data.document_end, or the token data.tokenizer puts after each document) "
                         "begins one, and so does a start token (the token data.tokenizer puts before each "
                         "document, its BOS); the end token is the last token of the document it ends. Refused "
                         "before launch when the corpus has no such token (a byte corpus without "
                         "data.document_end, a pre-tokenized .bin / .npy source) and with parallel.cp > 1 in a "
                         "ring mode (cp_mode 'all-to-all' is supported; docs/ecosystem.md, Document masking).",
                         "causal")
    reset_positions: bool = doc("With model.attn_mask = 'block_causal': rotary positions count from 0 at each "
                                "document's first token (Megatron's reset_position_ids), so a document is encoded "
                                "as if it began its own sequence. false: positions count along the window.", False)
    attention: str = doc("How block-causal attention (model.attn_mask = 'block_causal') is computed: 'sdpa' (one "
                         "additive (micro_batch, 1, seq, seq) mask in the compute dtype a forward, shared by the "
                         "layers: O(seq^2) memory, and sdpa leaves its flash kernel for it), 'flex' (FlexAttention "
                         "with a BlockMask of the documents: only the blocks a document covers are computed, "
                         "O(seq^2 / 128^2) memory; CUDA only, as torch has no FlexAttention backward on a CPU) or "
                         "'auto' (flex on a CUDA device when block_causal, sdpa otherwise). Causal attention "
                         "always runs sdpa's causal kernel (docs/ecosystem.md, Document masking).", "auto")
    fused_loss: bool = doc("Compute the output projection and the cross-entropy together in chunks of tokens, "
                           "recomputing each chunk's logits in backward: the (tokens x vocabulary) logits are "
                           "never held (with tp: the vocabulary-parallel loss, chunk by chunk). Same loss.", False)
    fused_loss_chunk: int = doc("With fused_loss: tokens per chunk (the largest logits held: chunk x vocabulary "
                                "/ tp, in fp32).", 1024)

    dlrm_dense_features: int = doc("DLRM: dense (continuous) features per sample (Criteo: 13).", 13)
    dlrm_bottom_mlp: str = doc("DLRM: hidden sizes of the bottom MLP, comma-separated; it ends at embedding.dim.",
                               "64,32")
    dlrm_top_mlp: str = doc("DLRM: hidden sizes of the top MLP, comma-separated; it ends at one logit.", "64,32")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        return -(-int(8 * self.dim / 3) // 64) * 64

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def q_bias(self) -> bool:
        """Whether the q, k and v projections have biases."""
        return self.attention_bias or self.qkv_bias

    @property
    def moe_ffn_dim(self) -> int:
        return self.moe_ffn_hidden or self.ffn_dim

    @property
    def moe_shared_ffn_dim(self) -> int:
        return self.moe_shared_expert_hidden or self.moe_ffn_dim

    @property
    def moe_dense_blocks(self) -> tuple[int, ...]:
        """``moe_dense_layers`` as block indices; raises ValueError on bad text."""
        text = self.moe_dense_layers.strip()
        return tuple(int(x) for x in text.split(",")) if text else ()

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (from 0) has experts: every ``moe_every``-th one, counting from 1,
        unless ``moe_dense_layers`` keeps it dense."""
        return (self.moe_experts > 0 and (index + 1) % max(1, self.moe_every) == 0
                and index not in self.moe_dense_blocks)


@dataclass
class ParallelConfig:
    """Degrees of each mesh axis; their product is the world size."""

    dp: int = doc("Data-parallel degree.", 1)
    dp_replicate: int = doc("Hybrid sharded data parallel (HSDP): the parallel.dp ranks are dp_replicate groups of "
                            "dp_shard adjacent ranks; ZeRO 1-3 cuts weights, gradients and optimizer state only "
                            "within a group (dp_shard x cp x sp ranks), whose reduced gradient shards are all-reduced "
                            "across the groups (docs/architecture.md, 'Hybrid sharded data parallel'). 1: ZeRO over "
                            "all of dp.", 1)
    dp_shard: int = doc("HSDP: data-parallel ranks per ZeRO group; 0 follows as parallel.dp / parallel.dp_replicate "
                        "(parallel.dp is the product of the two).", 0)
    tp: int = doc("Tensor-parallel degree (Megatron: heads and the MLP split over tp ranks).", 1)
    pp: int = doc("Pipeline-parallel degree (stages on different ranks; micro-batches = accumulation steps).", 1)
    pp_schedule: str = doc("Pipeline schedule: 'naive', 'gpipe', '1f1b', 'interleaved', 'zb-h1', or the "
                           "asynchronous 'pipedream-2bw' / 'pipedream' (no flush; see docs/async.md).", "1f1b")
    pp_vertical_sync: bool = doc("pp_schedule = 'pipedream': every stage runs a micro-batch with the weight version "
                                 "the first stage used (else each stage's newest at the forward).", False)
    pp_virtual: int = doc("Model chunks per pipeline rank (>= 2 only with pp_schedule = 'interleaved').", 1)
    pp_split: str = doc("Comma-separated layer indices that start stages 1..pp*v-1; '' balances by pp_balance.",
                        "")
    pp_balance: str = doc("Without pp_split: balance stages by 'layers' (count) or 'params' (parameter count).",
                          "layers")
    sp: int = doc("Ulysses sequence-parallel degree (sequence shards, all-to-all around attention).", 1)
    cp: int = doc("Context-parallel degree: each rank holds 2 of the sequence's 2 x cp chunks (chunks i and "
                  "2cp-1-i, which balances causal attention's work) and attention runs over the whole sequence "
                  "as parallel.cp_mode says (docs/context-parallel.md).", 1)
    cp_mode: str = doc("How context-parallel attention sees the other ranks' keys and values: 'ring' (passed "
                       "round the ring, point to point, online softmax), 'all-to-all' (Ulysses over the cp ranks: "
                       "whole sequence, a share of the heads) or 'hybrid' (Ulysses over parallel.sp inside, the "
                       "ring over cp across: the sequence cut cp x sp ways).", "ring")
    sequence_parallel: bool = doc("Megatron sequence parallelism on the tp axis: norms and residuals on "
                                  "sequence shards, all-gather / reduce-scatter instead of all-reduce.", False)
    ep: int = doc("Expert-parallel degree: experts are sharded over ep adjacent ranks of the dp x cp x sp "
                  "replicas (ep divides dp x cp x sp, under HSDP one ZeRO group's dp_shard x cp x sp, and adds no "
                  "ranks; model.moe_experts divisible by ep). Tokens reach their experts by all-to-all.", 1)
    moe_grouped_mm: bool = doc("Run each rank's experts with torch._grouped_mm (one grouped GEMM; CPU and "
                               "CUDA sm90+) instead of a loop over experts.", False)
    zero: int = doc("ZeRO stage over the ranks that hold replicas, dp x cp x sp (dp_shard x cp x sp under "
                    "parallel.dp_replicate): 0 (replicated), 1 (optimizer state), 2 (+ gradients), "
                    "3 (+ parameters).", 0)
    bucket_mb: float = doc("Gradient all-reduce bucket size in MiB (stage 0 in fp32).", 25.0)
    reshard_after_forward: bool = doc("ZeRO-3: free gathered parameters after forward and gather again for "
                                      "backward (False keeps them: less traffic, more memory).", True)
    prefetch: bool = doc("ZeRO-3: start gathering the next unit while the current one computes.", True)
    dp_sync: str = doc("How data-parallel replicas agree: 'sync' (gradients all-reduced every step) or "
                       "'local-sgd' (each replica steps alone on its own gradients; parameters are averaged "
                       "every parallel.local_sgd_every steps; optimizer state stays each replica's own).", "sync")
    local_sgd_every: int = doc("With dp_sync = 'local-sgd': average the replicas' parameters every K steps "
                               "(K = 1 is synchronous data parallel).", 1)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.sp * self.cp

    @property
    def split_points(self) -> list[int] | None:
        """``pp_split`` as layer indices (None when empty); raises ValueError on bad text."""
        text = self.pp_split.strip()
        return [int(x) for x in text.split(",")] if text else None


@dataclass
class PrecisionConfig:
    """Numeric formats."""

    mode: str = doc("Compute precision: 'fp32', 'bf16' or 'fp16' (both with fp32 master weights).", "fp32")
    reduce_dtype: str = doc("Gradient reduction dtype: 'auto' (bf16 for bf16, fp32 for fp32 and fp16: summing "
                            "loss-scaled fp16 gradients over ranks overflows) or 'fp32'.", "auto")
    loss_scale: float = doc("fp16: initial dynamic loss scale.", 65536.0)
    scale_growth_interval: int = doc("fp16: double the scale after this many steps without overflow.", 1000)
    scale_backoff: float = doc("fp16: multiply the scale by this after an overflow.", 0.5)
    fp8: str = doc("Float8 linear layers in the transformer blocks (norms, embedding, head, MoE routers and "
                   "master weights unchanged): 'none', 'tensorwise' or 'rowwise' (dynamic power-of-two scales, "
                   "one per tensor or one per row along each GEMM's reduction dimension); e4m3 inputs and "
                   "weights, e5m2 gradients. Needs CUDA capability >= 8.9 and precision.mode = 'bf16', "
                   "unless fp8_emulate (docs/precision.md).", "none")
    fp8_emulate: bool = doc("With fp8: quantize to float8 and back and multiply in the compute dtype instead of "
                            "float8 kernels: the same rounding, no speed-up (CPUs, older GPUs, tests).", False)


@dataclass
class MemoryConfig:
    """Trading compute for memory."""

    checkpointing: str = doc("Activation checkpointing: 'none', 'full', 'every' (every k-th block), or "
                             "'selective' (every block recomputes its norms and SwiGLU activation in backward "
                             "and keeps its linear layers' inputs; see selective_attention).", "none")
    checkpoint_every: int = doc("With checkpointing='every': checkpoint blocks 0, k, 2k, ...", 2)
    selective_attention: bool = doc("With checkpointing='selective': also recompute the attention core (SDPA). "
                                    "Off by default: flash attention keeps no attention matrix, so this drops only "
                                    "its log-sum-exp (4 bytes a head a token) for one more attention forward.",
                                    False)
    activation_offload: bool = doc("Move saved activations of at least offload_min_bytes to host memory during "
                                   "forward (pinned, on a side stream on GPU) and prefetch them one block ahead "
                                   "in backward. Composes with checkpointing (their inputs move too).", False)
    offload_min_bytes: int = doc("With activation_offload: smaller saved tensors stay on the device.", 1024)
    activation_compression: str = doc("'none', or 'int8': linear layers keep their saved inputs as int8 with one "
                                      "scale per row (token) and dequantize them for the weight gradient "
                                      "(approximate weight gradients; input gradients exact).", "none")


@dataclass
class OptimConfig:
    """The optimizer and its learning-rate schedule."""

    name: str = doc("Optimizer: 'adamw' (fused kernel where the device has one), 'adamw8bit' (both moments "
                    "block-wise 8-bit), 'adafactor' (factored second moment) or 'lion' (sign of momentum; "
                    "use a 3-10x smaller lr, beta2 0.99). Others plug in through "
                    "bigtrain.optim.register_optimizer; the tests register 'sgd_momentum'.", "adamw")
    lr: float = doc("Peak learning rate (before linear scaling, if enabled).", 3e-3)
    schedule: str = doc("The learning rate after the warm-up: 'cosine' (a cosine from the peak down to the floor, "
                        "reached at train.steps), 'linear' (a straight line down to it), 'wsd' (warm-up, stable, "
                        "decay: the peak until the last optim.decay_fraction of the steps, then a straight line down "
                        "to the floor; a run extended on resume keeps its stable part) or 'constant' (the peak).",
                        "cosine")
    min_lr_ratio: float = doc("The floor the schedule decays to, as a fraction of the peak.", 0.1)
    decay_fraction: float = doc("schedule = 'wsd': the fraction of train.steps at the end that decays.", 0.2)
    warmup_steps: int = doc("Linear warm-up steps.", 20)
    weight_decay: float = doc("Weight decay on matrices, not on norms or vectors (AdamW: decoupled; "
                              "'sgd_momentum': L2, added to the gradient).", 0.1)
    beta1: float = doc("Adam beta1; the momentum of momentum SGD ('sgd_momentum').", 0.9)
    beta2: float = doc("Adam beta2.", 0.95)
    eps: float = doc("Adam epsilon.", 1e-8)
    grad_clip: float = doc("Global gradient-norm clip; 0 disables.", 1.0)
    block_size: int = doc("adamw8bit: elements per quantization block (one fp32 scale per moment each); "
                          "ZeRO and tensor-parallel cuts must fall on block boundaries.", 256)
    adafactor_decay: float = doc("adafactor: 1 - beta2 at step t is t ** adafactor_decay (torch's beta2_decay).",
                                 -0.8)
    adafactor_clip: float = doc("adafactor: the update is scaled down to this RMS at most (torch's d).", 1.0)
    adafactor_eps: float = doc("adafactor: the smallest parameter RMS the relative step size uses (torch's "
                               "eps[1]).", 1e-3)
    lr_scaling: str = doc("'none', or 'linear': lr x global_batch / base_batch (Goyal et al.).", "none")
    base_batch: int = doc("Reference global batch for linear lr scaling.", 8)


@dataclass
class OffloadConfig:
    """Model states beyond device memory (ZeRO-Offload / ZeRO-Infinity)."""

    optimizer: str = doc("'none', 'cpu' (fp32 master weights and optimizer state in host memory, stepped there "
                         "unit by unit with the fused CPU kernel) or 'nvme' (the same, kept in files under "
                         "offload.nvme_dir and read in for their unit's step). Needs parallel.zero >= 1.", "none")
    params: str = doc("'none', 'cpu' (ZeRO-3's parameter shards in host memory, gathered onto the device unit by "
                      "unit: on a CPU device they are there already) or 'nvme' (the shards, fp32 masters in fp32, "
                      "live in files and are read in just before their unit is gathered). Needs parallel.zero = 3.",
                      "none")
    masters: str = doc("Where the fp32 master weights live when they are apart from the compute weights: 'auto' "
                       "(with the optimizer's state: in files under offload.optimizer = 'nvme') or 'cpu' (in host "
                       "memory, while the optimizer's state is in files: ZeRO-Infinity's split, for a host that "
                       "holds masters and gradients but not the state too). 'cpu' needs offload.optimizer = 'nvme'.",
                       "auto")
    nvme_dir: str = doc("Directory for offload files (a fast local disk); '' means <run dir>/offload.", "")
    prefetch_depth: int = doc("NVMe: units whose files are read ahead of the one being stepped (0: none, each "
                              "unit read when its step needs it). ZeRO-3's gathers read one unit ahead, in "
                              "their own order, whatever this says.", 1)
    grad_buckets: int = doc("With the host apart from the device (a GPU): device buffers (the largest unit's "
                            "gradient shard each, in the reduce dtype) that reduced gradients pass through on "
                            "their way to their fp32 accumulators in host memory; the device never holds more "
                            "(nor a whole fp32 gradient). The planner counts this many.", 4)
    delayed_update: bool = doc("ZeRO-Offload's one-step delayed parameter update: the host optimizer step of step t "
                               "runs on a worker thread during step t+1's forward and backward, which computes with "
                               "the weights from before that update (W(t+1) = W(t) - lr * g(W(t-1))). Needs "
                               "offload.optimizer = 'cpu' or 'nvme', parallel.pp = 1.", False)


@dataclass
class DataConfig:
    """Where tokens come from."""

    source: str = doc(
        "'stdlib' (this machine's Python standard library), a text file, a JSON Lines (.jsonl) or Parquet "
        "(.parquet, needs pyarrow) file of records, a folder of such files, or a pre-tokenized .bin (uint16) / "
        ".npy file.",
        "stdlib",
    )
    tokenizer: str = doc("'bytes' (a token is a byte of UTF-8 text; vocabulary 256), or a local Hugging Face "
                         "tokenizer.json (or a folder holding one; needs the tokenizers package) or tiktoken "
                         "encoding file (needs tiktoken). Text is tokenized once, in parallel, into shards cached "
                         "in data.cache_dir; `bigtrain export --format hf` writes it beside the weights.", "bytes")
    text_field: str = doc("JSON Lines / Parquet sources: the key (column) that holds each record's text.", "text")
    document_end: str = doc("A token put after each document, as the token id it is in data.tokenizer, e.g. "
                            "'<|endoftext|>' (GPT-2, Qwen) or '</s>' (Llama 2): documents then meet at it "
                            "instead of running into each other. It must be one token of the tokenizer; one that the "
                            "tokenizer already puts after each document is not put a second time. '' puts nothing "
                            "(a tokenizer may add its own).", "")
    seq_len: int = doc("Tokens per sample.", 128)
    cache_dir: str = doc("Where tokenized corpora are cached; '' means ~/.cache/bigtrain.", "")
    max_bytes: int = doc("Cap on the bytes of text read from a corpus, before tokenizing (0: no cap).", 16_000_000)
    ignore_target: int = doc("A token id whose next-token targets are left out of the loss (padding or a "
                             "separator, say); the loss is the mean over the targets kept. -1: keep all.", -1)
    val_fraction: float = doc("Hold out this fraction of the corpus (its last tokens) for validation: training "
                              "windows never reach into it, whatever the layout. 0: no held-out data.", 0.0)
    blend: str = doc("Corpora to train on besides data.source, each with its share of the training windows: "
                     "'PATH=SHARE, PATH=SHARE' (each share in (0, 1), together below 1; data.source takes the rest), "
                     "e.g. 'code.jsonl=0.3, math.txt=0.1'. Each is read as data.source is (any form it takes, the "
                     "same tokenizer, text field and caps) and keeps its own data.val_fraction tail. '': "
                     "data.source alone.", "")
    val_source: str = doc("A held-out corpus of its own, for validation instead of a fraction of data.source (a "
                          "validation split, nanoGPT's val.bin): any form data.source takes, read with the same "
                          "tokenizer, text field and data.max_bytes. '': none (data.val_fraction, if set).", "")


@dataclass
class TrainConfig:
    """The loop."""

    steps: int = doc("Optimizer steps.", 200)
    global_batch: int = doc("Sequences per optimizer step = micro_batch x accumulation x dp.", 8)
    micro_batch: int = doc("Sequences per forward/backward on one rank.", 8)
    seed: int = doc("Seed for weights and data sampling.", 1234)
    device: str = doc("'auto' (cuda if present), 'cpu' or 'cuda'.", "auto")
    max_bad_steps: int = doc("Stop the run (exit code 3) after this many consecutive steps with a non-finite loss "
                             "or gradient norm; each is skipped on every rank, weights untouched. fp16 overflows "
                             "count only once the loss scale is at its minimum.", 5)
    eval_every: int = doc("Every N steps (and at the last one), the mean loss over train.eval_batches global "
                          "batches of held-out windows (data.val_fraction), logged as eval_loss. 0: never.", 0)
    eval_batches: int = doc("With eval_every: global batches of held-out windows per evaluation (the same "
                            "windows every time, spread evenly over the held-out slice).", 4)

    def grad_accum(self, dp: int) -> int:
        return self.global_batch // (self.micro_batch * dp)


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    every: int = doc("Save every N steps (0: by every_minutes only).", 0)
    every_minutes: float = doc("Also save when this many minutes of training have passed since the last save "
                               "(turned into a step count every rank agrees on, from the measured pace); 0: "
                               "never by time. With every = 0 as well, only at the end.", 15.0)
    keep: int = doc("Keep the newest K checkpoints.", 2)
    resume: str = doc("'none', 'auto' (continue this run: its newest valid checkpoint in the run directory, "
                      "or a fresh start if it has none), or the path of a checkpoint (or a checkpoints/ folder) "
                      "to start from. `bigtrain train --output-dir RUN --resume` sets 'auto' and reads "
                      "RUN/config.toml.", "none")
    save_final: bool = doc("Save at the end of the run.", True)
    # ``checkpoint.async`` is a Python keyword: declared through the class namespace, outside
    # ``__init__`` (whose generated signature could not name it), default set below; read it with
    # ``getattr(cfg.checkpoint, "async")``.
    __annotations__["async"] = bool
    locals()["async"] = field(init=False, repr=False, compare=False, metadata={"doc": (
        "Write checkpoints in a background thread, overlapping training: each rank snapshots its shards "
        "at the save step; the manifest is written once every rank's files are.")})


setattr(CheckpointConfig, "async", False)


@dataclass
class LoggingConfig:
    """What the run reports."""

    log_every: int = doc("Write a metrics line every N steps.", 10)
    progress: bool = doc("Show a progress bar on rank 0 when stdout is a terminal (elsewhere, and with false: "
                         "one plain line per logged step).", True)
    report: bool = doc("Write report.md and a loss-curve PNG at the end.", True)
    measure_memory: bool = doc("Measure saved-activation bytes on logged steps.", True)
    tensorboard: bool = doc("Also write each logged step's loss, held-out loss, learning rate, gradient norm, "
                            "tokens/s and memory as TensorBoard event files in RUN_DIR/tensorboard (torch's "
                            "SummaryWriter; needs `pip install tensorboard`, else a warning and no files).", False)
    profile_steps: str = doc("Trace these steps with torch.profiler, 'A-B' or 'A' (counted from 1, as the console "
                             "counts; e.g. '5-6', after the warm-up): each rank writes a Chrome trace of its "
                             "operators, kernels, collectives and the trainer's phases to "
                             "RUN_DIR/profile/rank{R}_steps{A}-{B}.json (open in https://ui.perfetto.dev). "
                             "'': no trace.", "")
    profile_memory: bool = doc("With profile_steps: record allocations in the trace too, and on a GPU dump the "
                               "caching allocator's history of those steps to RUN_DIR/profile/rank{R}_memory.pickle "
                               "(https://pytorch.org/memory_viz).", False)


@dataclass
class EmbeddingConfig:
    """The recommender's embedding tables (model.family = 'dlrm'): one sum-pooled table per sparse feature."""

    tables: str = doc("Rows of each table, comma-separated; 'NxR' repeats R N times (Criteo: 26 tables).",
                      "26x1000")
    dim: int = doc("Embedding dimension (every table; the bottom MLP ends at it).", 16)
    hotness: int = doc("Ids per sample and sparse feature, summed (1: one-hot; more: multi-hot).", 1)
    sharding: str = doc("How tables are placed over the ranks: 'auto' (the planner picks per table), 'table' "
                        "(whole tables, balanced over ranks), 'row' (rows cut over all ranks), 'column' "
                        "(columns cut over all ranks), 'data' (a replica on every rank), or one of these per "
                        "table, comma-separated. Lookups travel by all-to-all.", "auto")
    optimizer: str = doc("Sparse optimizer of the tables, applied in backward to the rows in the batch only: "
                         "'rowwise_adagrad' (one accumulator per row) or 'sgd'.", "rowwise_adagrad")
    lr: float = doc("Learning rate of the tables' sparse optimizer (constant).", 0.05)
    eps: float = doc("Row-wise Adagrad epsilon.", 1e-8)
    budget_gb: float = doc("Per-rank memory for the tables and their optimizer state, for the planner "
                           "(GiB; 0: no limit).", 0.0)


@dataclass
class DistributedConfig:
    """The process group."""

    timeout_s: float = doc("Seconds (1 to a year) a rank waits in a collective, or for its peers to join, "
                           "before it fails naming the collective, its axis and tag; a frozen or dead peer is "
                           "found this long after it stopped.", 600.0)


@dataclass
class CompileConfig:
    """torch.compile (docs/compile.md)."""

    enabled: str = doc("Compile each transformer block on its own with torch.compile (regional compilation, static "
                       "shapes; the final norm and the plain loss too): 'auto' (on a CUDA device, not on a CPU: "
                       "measured in docs/compile.md), true or false. The first step pays the compile time "
                       "(reported as compile_s); no step after recompiles.", "auto")

"""Every KESTREL_* environment variable, typed, with its default. Nothing else reads os.environ."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, how its text reads, its default. kind:
    - "choice": one of `choices`, any case;
    - "flag": on (1, true, yes, on) or off (0, false, no, off), any case;
    - "switch": auto, on or off (1 and 0 and the flag's other words too);
    - "count": a whole number >= 0;
    - "path": a filesystem path, as given (case kept), or "" where unset;
    - "loose": Triton's own flags' rule (on for 1, true, yes, on, y; anything else off, never an error).
    Unset or blank: the default. `fallback` is read where `name` is unset (CUDA_PATH after CUDA_HOME)."""

    name: str
    kind: str
    default: str | bool | int
    choices: tuple[str, ...] = ()
    fallback: str | None = None
    what: str = ""  # a few words for `kestrel env`'s table (the Env field's description says the rest)

    def text(self) -> str:
        """The variable's text as set ("" where unset), its fallback's where it is unset."""
        value = os.environ.get(self.name, "").strip()
        if not value and self.fallback:
            value = os.environ.get(self.fallback, "").strip()
        return value

    def read(self):
        """Its value, or ValueError naming the variable and what it takes."""
        value = self.text()
        if self.kind == "path" or not value:
            return value or self.default
        value = value.lower()
        if self.kind == "choice" and value in self.choices:
            return value
        if self.kind == "loose":
            return value in (*_ON, "y")
        if self.kind == "flag" and value in _ON + _OFF:
            return value in _ON
        if self.kind == "switch":
            value = "on" if value in _ON else "off" if value in _OFF else value
            if value in ("auto", "on", "off"):
                return value
        if self.kind == "count" and value.isdigit():
            return int(value)
        raise ValueError(f"{self.name}={value!r}: expected {self.takes()}")

    def takes(self) -> str:
        """What the variable takes, in words."""
        return {
            "choice": " | ".join(self.choices),
            "flag": "on | off, 1 | 0, true | false, yes | no",
            "switch": "auto | on | off (1 | 0)",
            "count": "a whole number >= 0",
            "path": "a path",
            "loose": "1 | 0 (Triton's rule: 1, true, yes, on, y are on)",
        }[self.kind]


@dataclass(frozen=True)
class Env:
    kda_backend: str
    """KESTREL_KDA_BACKEND: auto (fla-core on CUDA, reference elsewhere) | naive | fla."""
    log_level: str
    """KESTREL_LOG_LEVEL: the server's log level where `kestrel serve --log-level` is not given: debug | info |
    warning | error."""
    attn_backend: str
    """KESTREL_ATTN_BACKEND: MLA/DSA decode over the paged cache: auto (Triton kernels on CUDA) | torch | triton."""
    moe_grouped_mm: str
    """KESTREL_MOE_GROUPED_MM: auto (torch._grouped_mm on CUDA bf16 where it applies) | off (per-expert loop)."""
    moe_decode_kernel: str
    """KESTREL_MOE_DECODE_KERNEL: auto (the routed experts in Triton on CUDA at inference when T * A <=
    kestrel.layers.moe.TRITON_EXPERTS_MAX_PAIRS) | off (the grouped path at every size)."""
    kda_conv: str
    """KESTREL_KDA_CONV: the KDA short conv of prefill and training on the fla backend: auto (inference: one
    Triton kernel, kestrel.ops.kda.triton_conv.short_conv_prefill; training: fla-core's causal_conv1d on CUDA,
    the packed torch form with its backward elsewhere) | torch (the packed form, kestrel.ops.kda.packed_conv,
    always) | fla (fla-core's varlen causal_conv1d, Triton forward and backward)."""
    kda_decode: str
    """KESTREL_KDA_DECODE: the KDA decode step on the state slots on the fla backend: triton (ours,
    kestrel.ops.kda.triton_recurrent: on the H200 at mini's sizes 75 vs 90 us a layer at batch 256, 3.5 vs 5.6 at
    batch 1, session 20) | fla (fla-core's fused_recurrent_kda_fwd)."""
    kda_no_recompute: bool
    """KESTREL_KDA_NO_RECOMPUTE: training keeps fla chunk_kda's forward intermediates for the backward instead of
    recomputing them (fla's advice for small models). On by default: with KESTREL_KDA_SAFE_GATE, mini's training
    step on the H200 (2 rows of 8704 tokens) took 0.511 / 0.547 s dense / sparse against 0.579 / 0.624 s
    without both (session 29, the same machine), for 4.4 GiB more at the peak (97.8 GiB)."""
    kda_recurrent_prefill: int
    """KESTREL_KDA_RECURRENT_PREFILL: at inference on the fla backend, a prefill step of at most this many KDA
    tokens (all its sequences together) runs fla's fused recurrent kernel, one launch per layer, instead of the
    chunked form's ten: a short append to a long cached history is bound by the host's launches (0: never).
    Measured on the H200 with a 500-token append (948 KDA tokens with its checkpoint segment): 59 vs 75 ms; the
    recurrent kernel walks each sequence token by token, so its time grows with the longest one (untimed past
    that). Which form runs depends on the step's total tokens, so rounding can depend on the batch."""
    sparse_prefill: str
    """KESTREL_SPARSE_PREFILL: the DSA layers' sparse prefill on the Triton backend: auto (expanded where the
    chunk's causal pairs cost less than its selected pairs in the rows kernel, `use_expanded`; rows elsewhere) |
    rows (every prefill token a row of the decode kernel, gathering its own selection, absorbed form) | expanded
    (kestrel.ops.mla.triton_prefill_expanded: per-head keys and values expanded once per chunk, blocks of queries
    of one head share each key tile, the selection as a mask; at every length). On the H200 mini's 8 x 4096
    prefill step took 216 ms with auto (expanded) against 380 ms with rows; an absorbed-form masking kernel took
    445 ms and was removed (bench/results/2026-11-30-h200-session9.json)."""
    moe_overlap_shared: bool
    """KESTREL_MOE_OVERLAP_SHARED: at inference on CUDA, up to kestrel.layers.moe.OVERLAP_SHARED_MAX_TOKENS tokens,
    the shared experts run on a side stream beside the routed ones (decode: parallel branches of the step's
    CUDA graph), as SGLang does for DeepSeek's. On by default: mini's decode step on the H200 in CUDA graphs,
    batch 1 / 64, 2.75 / 5.82 ms against 3.04 / 6.14 ms in line (the same ops; the output is bit for bit the
    same)."""
    moe_sort_first: bool
    """KESTREL_MOE_SORT_FIRST: where the shared experts run on a side stream and the routed ones in Triton, sort
    the routed pairs (`sort_pairs`) before the fork instead of after it. On by default: in mini's decode step on
    the H200 (session 21, CUDA-graph replay) batch 64 4.57 vs 4.65 ms, batch 256 7.28 vs 7.45 ms; the sort had
    taken 19-20 us a call beside the side stream against 6.9 us alone."""
    moe_fuse_shared: bool
    """KESTREL_MOE_FUSE_SHARED: up to kestrel.layers.moe.OVERLAP_SHARED_MAX_TOKENS tokens, where the routed experts
    run in Triton and the shared MLP has their width (one shared expert, no latent MoE), the shared MLP runs
    inside the routed experts' launches as one more expert every token takes (`moe_experts_triton(shared=)`):
    its gate_up, activation and down kernels and the add of its output are gone, and no side stream is forked
    (so KESTREL_MOE_OVERLAP_SHARED and KESTREL_MOE_SORT_FIRST apply only where it does not). On by default:
    mini's decode step on the H200 (session 21, CUDA-graph replay, off / on) batch 1 2.29 / 2.15 ms (618 / 522
    kernels), 64 4.54 / 4.40, 256 7.22 / 7.04."""
    moe_fused_decode: bool
    """KESTREL_MOE_FUSED_DECODE: at inference on CUDA, up to kestrel.layers.moe.FUSED_DECODE_MAX_TOKENS tokens, a
    MoE layer with one expert group, no latent MoE, one device's experts and a shared MLP of the experts' width
    (or none) runs whole in one launch (kestrel.ops.moe.triton_decode: router, routed and shared experts,
    combine, residual add; grid barriers between the phases) instead of six. On by default since session 39: on
    the H200 (mini's sizes, a CUDA graph of 24 layers) the one launch takes 18.1 us a layer against the six
    launches' 22.9 (5.3 us of bytes), and mini's batch-1 decode step 1.56 against 1.67 ms (graph replay);
    sessions 34-38's versions had lost to the six (28-31 us)."""
    kda_safe_gate: bool
    """KESTREL_KDA_SAFE_GATE: fla chunk_kda's faster path for gates bounded in [-5, 0) (K3's lower-bound gate),
    used only where the model's gate is bounded, and only in training (where autograd records: its forward and
    gradients passed their GPU test; inference's prefill keeps the general kernels, whose outputs the engine's
    GPU tests cover). On by default: see KESTREL_KDA_NO_RECOMPUTE for the two together on a training step."""
    compile_train: str
    """KESTREL_COMPILE_TRAIN=auto|on|off (1/0 too): torch.compile the small fp32 elementwise ops (norms, gates,
    activations, AttnRes mixing) when autograd records, i.e. in training, so that each runs as one fused kernel
    forward and backward (kestrel.utils.fuse). auto: on CUDA tensors only (the demo's training step on the H200,
    8 x 8704 tokens: 0.237 / 0.297 s dense / sparse against 0.325 / 0.388 s eager, session 10); on the CPU the
    compile costs more than it saves at test sizes."""
    train_attention: str
    """KESTREL_TRAIN_ATTENTION: the MLA attention of training's row-packed documents on CUDA: flex (the default:
    FlexAttention over the blocks the mask leaves visible, kestrel.ops.mla.flex_rows; rows of a multiple of 128
    tokens, else sdpa) | sdpa (one dense masked kernel over every row's R x R pairs). On `mini`, 2 rows of 8704
    tokens, the training step took 0.619 s with flex (torch's tiles) against 0.685 s with sdpa in the same call
    (session 28); the tuned tiles took flex's forward and backward from 10.2 to 6.4 ms a layer."""
    fused_ops: str
    """KESTREL_FUSED_OPS: inference on CUDA runs the norms, GLU activations and AttnRes mixing as one Triton
    kernel each (kestrel.utils.fuse): auto | off (the plain-torch references)."""
    dsa_topk: str
    """KESTREL_DSA_TOPK: the exact DSA top-k on the Triton attention backend (CUDA): auto (the CUDA kernel,
    kestrel.ops.dsa.cuda_topk, built by nvcc on first use, where it builds and passes its probe; else Triton's,
    kestrel.ops.dsa.triton_topk, with a warning) | cuda (the CUDA kernel; an error when it cannot be built) |
    triton. All select the same positions; on the H200 the CUDA kernel took 43.2 us for 64 x 131072 scores,
    k = 2048, against Triton's 134 and torch.topk's 192.5 in the same run (2026-12-01, session 19)."""
    dsa_topk_registers: str
    """KESTREL_DSA_TOPK_REGISTERS: auto (the default) | off. auto: the CUDA top-k runs decode's short rows (up to
    256 rows of at most 8192 scores) in its register variants (kestrel.ops.dsa.cuda_topk's `topk_short_kernel`,
    one read of the row, four 8-bit digits over keys held in registers); off: the shared-memory variants as
    before (session 24's picks). The same selection either way."""
    dsa_topk_rows: str
    """KESTREL_DSA_TOPK_ROWS: off (the default) | on. on: where decode's top-k is the CUDA kernel and its pick a
    register variant (KESTREL_DSA_TOPK_REGISTERS), that launch also writes the selected positions' pool rows
    (kestrel.ops.dsa.cuda_topk's `topk_cuda_with_rows`), and the sparse MLA decode takes them instead of
    translating the positions in a launch of its own (triton_decode's `selected_rows`): one launch fewer a DSA
    layer and step (6 a step on mini). A replayed selection (RL) and every other top-k keep the separate
    translation. Its GPU tests pass (the same rows and output as off, bit for bit; session 59, H100), but mini's
    batch-1 step was slower with it in both rounds of one call (1.450 / 1.445 ms against 1.436 / 1.435; likely the
    page-table reads after the selection, on the top-k's own path): off."""
    gemv: str
    """KESTREL_GEMV: at inference on a GPU where PDL is on (Hopper and later), linear layers over at most
    kestrel.ops.linear.GEMV_MAX_ROWS rows run the Triton GEMV (kestrel.ops.linear.triton_gemv: launched with PDL,
    its weights asked for before it waits) instead of cuBLAS: auto | rows | dot | off. auto: the rows kernel
    (`_gemv_rows_kernel`, each program's weights in one load issued before the PDL wait) up to
    triton_gemv.ROWS_AUTO_M rows, the K-loop kernel (`_gemv_kernel`, tl.dot over K steps) above (session 56 on an
    H100: the batch-1 step 1.458 ms against the K loop's 1.550; at 4 rows the K loop was faster); rows: the rows
    kernel up to triton_gemv.ROWS_MAX_M rows; dot: the K-loop kernel for every row count; off: cuBLAS."""
    gemv_fuse: str
    """KESTREL_GEMV_FUSE: where the rows kernel runs (KESTREL_GEMV), what it takes in besides the projection:
    none | gate (the output projections of KDA and MLA make their gated input in its prologue: KDA's per-head
    norm-gate, MLA's sigmoid gate) | conv (KDA's input projection runs the short-conv decode step on its q|k|v
    columns in its epilogue) | all | auto (the default: gate at one row only). gate: 24 launches a mini decode step
    fewer, conv: 18. Sessions 56-57 (H100, three runs): batch 1's replay 1.441-1.450 ms with gate against
    1.458-1.461 with none; batch 2 1.753-1.755 against 1.717-1.725 (hence one row); conv never won (batch 4 +18-24%)."""
    pdl: str
    """KESTREL_PDL: the decode step's Triton kernels launch with programmatic dependent launch on Hopper and later
    (kestrel.ops.pdl): auto | off."""
    cache_dir: str
    """KESTREL_CACHE_DIR: where Kestrel keeps what it builds on first use (the CUDA top-k's library, under
    cuda/); unset: ~/.cache/kestrel."""
    cuda_home: str
    """CUDA_HOME (or CUDA_PATH, CUDA's own variables): the toolkit whose bin/nvcc builds the CUDA top-k; unset:
    /usr/local/cuda, then nvcc on PATH."""
    triton_interpret: bool
    """TRITON_INTERPRET (Triton's own switch): kernels run in Triton's interpreter, so the CUDA-only fast paths
    can be exercised on a CPU (tests)."""


def _choice(name: str, default: str, choices: tuple[str, ...], what: str) -> Variable:
    assert default in choices, name
    return Variable(name, "choice", default, choices, what=what)


# One declared variable per Env field, in the order `kestrel env` lists them.
VARIABLES: dict[str, Variable] = {
    "kda_backend": _choice(
        "KESTREL_KDA_BACKEND", "auto", ("auto", "naive", "fla"), what="KDA kernels (fla-core on CUDA)"
    ),
    "kda_conv": _choice(
        "KESTREL_KDA_CONV", "auto", ("auto", "torch", "fla"), what="KDA short conv of prefill and training"
    ),
    "kda_decode": _choice(
        "KESTREL_KDA_DECODE", "triton", ("triton", "fla"), what="KDA decode step on the state slots"
    ),
    "kda_recurrent_prefill": Variable(
        "KESTREL_KDA_RECURRENT_PREFILL",
        "count",
        1024,
        what="prefills of up to N KDA tokens run the recurrent kernel",
    ),
    "kda_no_recompute": Variable(
        "KESTREL_KDA_NO_RECOMPUTE", "flag", True, what="training keeps chunk_kda's intermediates"
    ),
    "kda_safe_gate": Variable(
        "KESTREL_KDA_SAFE_GATE", "flag", True, what="training: fla's kernels for bounded gates"
    ),
    "attn_backend": _choice(
        "KESTREL_ATTN_BACKEND",
        "auto",
        ("auto", "torch", "triton"),
        what="MLA/DSA kernels over the paged cache",
    ),
    "sparse_prefill": _choice(
        "KESTREL_SPARSE_PREFILL", "auto", ("auto", "rows", "expanded"), what="DSA sparse prefill's form"
    ),
    "dsa_topk": _choice(
        "KESTREL_DSA_TOPK", "auto", ("auto", "cuda", "triton"), what="the exact DSA top-k's kernel"
    ),
    "dsa_topk_registers": _choice(
        "KESTREL_DSA_TOPK_REGISTERS",
        "auto",
        ("auto", "off"),
        what="the CUDA top-k's register variants for short rows",
    ),
    "dsa_topk_rows": _choice(
        "KESTREL_DSA_TOPK_ROWS",
        "off",
        ("on", "off"),
        what="decode's CUDA top-k also writes the pool rows",
    ),
    "moe_grouped_mm": _choice(
        "KESTREL_MOE_GROUPED_MM", "auto", ("auto", "off"), what="MoE experts through torch._grouped_mm"
    ),
    "moe_decode_kernel": _choice(
        "KESTREL_MOE_DECODE_KERNEL", "auto", ("auto", "off"), what="MoE experts in Triton at decode sizes"
    ),
    "moe_overlap_shared": Variable(
        "KESTREL_MOE_OVERLAP_SHARED", "flag", True, what="shared experts on a side stream"
    ),
    "moe_sort_first": Variable(
        "KESTREL_MOE_SORT_FIRST", "flag", True, what="sort the routed pairs before that fork"
    ),
    "moe_fuse_shared": Variable(
        "KESTREL_MOE_FUSE_SHARED", "flag", True, what="shared expert inside the routed launches"
    ),
    "moe_fused_decode": Variable(
        "KESTREL_MOE_FUSED_DECODE", "flag", True, what="a batch-1 MoE layer in one launch"
    ),
    "fused_ops": _choice(
        "KESTREL_FUSED_OPS", "auto", ("auto", "off"), what="norms, activations, mixing as one kernel each"
    ),
    "gemv": _choice(
        "KESTREL_GEMV",
        "auto",
        ("auto", "rows", "dot", "off"),
        what="Triton GEMV for projections of up to 16 rows",
    ),
    "gemv_fuse": _choice(
        "KESTREL_GEMV_FUSE",
        "auto",
        ("auto", "none", "gate", "conv", "all"),
        what="ops inside the rows GEMV, where it runs",
    ),
    "pdl": _choice("KESTREL_PDL", "auto", ("auto", "off"), what="programmatic dependent launch (Hopper)"),
    "compile_train": Variable(
        "KESTREL_COMPILE_TRAIN", "switch", "auto", what="training compiles the small elementwise ops"
    ),
    "train_attention": _choice(
        "KESTREL_TRAIN_ATTENTION", "flex", ("flex", "sdpa"), what="training's row attention"
    ),
    "log_level": _choice(
        "KESTREL_LOG_LEVEL", "info", ("debug", "info", "warning", "error"), what="the server's log level"
    ),
    "cache_dir": Variable("KESTREL_CACHE_DIR", "path", "", what="where built kernels are kept"),
    "cuda_home": Variable(
        "CUDA_HOME", "path", "", fallback="CUDA_PATH", what="the CUDA toolkit (nvcc) for the top-k"
    ),
    "triton_interpret": Variable("TRITON_INTERPRET", "loose", False, what="Triton's interpreter (CPU tests)"),
}


# KESTREL_* names read outside Python: ./run's virtual environment (default .venv in the checkout)
SHELL_VARIABLES = ("KESTREL_VENV",)
_WARNED: set[str] = set()  # the unknown-variable lines check_env has logged


def unknown_variables() -> list[str]:
    """One line for each KESTREL_* variable set that nothing reads (a misspelling is otherwise silently the
    default), with the closest known name where one is close."""
    import difflib

    known = [v.name for v in VARIABLES.values()] + list(SHELL_VARIABLES)
    lines = []
    for name in sorted(n for n in os.environ if n.startswith("KESTREL_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1)
        lines.append(f"{name} is not a Kestrel variable" + (f" (did you mean {close[0]}?)" if close else ""))
    return lines


def read_env() -> Env:
    """Every variable's value; ValueError at the first bad one (`env_problems` lists them all)."""
    return Env(**{field: variable.read() for field, variable in VARIABLES.items()})


def env_problems() -> list[str]:
    """One line for each variable whose text is not one it takes (nothing where all read): checked before a
    command or an engine starts, so that a bad value is an error at once, not at the first step that reads it."""
    problems = []
    for variable in VARIABLES.values():
        try:
            variable.read()
        except ValueError as e:
            problems.append(str(e))
    return problems


def check_env() -> None:
    """A ConfigError naming every bad variable at once (see `env_problems`); nothing where all read. A KESTREL_*
    variable that nothing reads is a warning (`unknown_variables`)."""
    import logging

    for line in unknown_variables():
        if line not in _WARNED:  # once a process: a command checks, then its Engine does
            _WARNED.add(line)
            logging.getLogger("kestrel").warning("%s; `kestrel env` lists every variable", line)
    problems = env_problems()
    if problems:
        from kestrel.utils.errors import ConfigError

        raise ConfigError(
            "bad environment variable"
            + ("s: " if len(problems) > 1 else ": ")
            + "; ".join(problems)
            + " (`kestrel env` lists every variable and what it takes)"
        )


def env_field(name: str):
    """One field of `Env`, its variable read alone: for the hot path (a layer's forward, each call), where
    `read_env()` parsing every variable takes about 10 us and this under 1."""
    return VARIABLES[name].read()


def fused_ops_on() -> bool:
    """KESTREL_FUSED_OPS alone (is it auto?): every fused op asks at each inference call."""
    return env_field("fused_ops") == "auto"


@contextlib.contextmanager
def env_overrides(switches: dict[str, str]) -> Iterator[None]:
    """The environment variables `switches` set for the block, then restored (or removed) after it: for the
    scripts that time one path against another in one process (the switches are read at each call)."""
    saved = {name: os.environ.get(name) for name in switches}
    os.environ.update(switches)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

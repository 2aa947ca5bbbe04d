"""HF safetensors checkpoints <-> Kestrel parameters (model-spec section 8).

Reading understands, for `kimi_linear`: the original Moonshot layout (`block_sparse_moe.experts.{e}.w1`,
`self_attn.q_conv1d`, ...) and the layout of transformers' `KimiLinearForCausalLM` modules (`mlp.experts.gate_up_proj`,
`self_attn.conv1d`, `self_attn.forget_gate.*`); for `kimi_k3`: the `language_model.` prefix and MXFP4 experts
(`weight_packed` / `weight_scale`, dequantized at load); and the DSA `self_attn.indexer.*` tensors.
Files: one `model.safetensors`, or shards listed in `model.safetensors.index.json`.

Every problem found (missing, unexpected, wrong shape) is collected and raised once as a `CheckpointError`.
Writing emits the checkpoint layout of the model's `config.model_type` (Moonshot names for kimi_linear).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kestrel.config import KDA, MOE, ModelConfig
from kestrel.layers.linear import ShapeMismatch
from kestrel.layers.moe import ALL_EXPERTS
from kestrel.models.kimi import KimiForCausalLM
from kestrel.ops.quant.mxfp4 import pack_mxfp4, unpack_mxfp4
from kestrel.utils.dist import parallel_state
from kestrel.utils.errors import CheckpointError

# Tensors of a multimodal K3 checkpoint that the text model does not use.
_IGNORED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "mm_projector.", "vision_model.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(
    r"^mlp\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(weight|weight_packed|weight_scale)$"
)
_EXPERT_PART = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2", "down_proj": "w2"}
_GLU = {"gate_proj": "gate", "up_proj": "up"}


def _canonical(name: str) -> str | None:
    """Strip the format's prefix and unify Moonshot/transformers/K3 module names; None = not a text tensor."""
    for prefix in ("language_model.", ""):
        if name.startswith(prefix + "model.") or name.startswith(prefix + "lm_head."):
            name = name[len(prefix) :]
            break
        if prefix and name.startswith(prefix + "layers."):
            name = "model." + name[len(prefix) :]
            break
    else:
        return None
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
    return name


def _targets(config: ModelConfig, name: str, tensor_fn):
    """Map one canonical checkpoint name to [(param name, shard id, tensor getter)], [] if not ours."""
    m = _LAYER.match(name)
    if m is None:
        return [(name, None, tensor_fn)]
    layer, rest = int(m.group(1)), m.group(2)
    prefix = f"model.layers.{layer}."
    if layer >= config.num_hidden_layers:
        return []
    kda = config.layer_types[layer] == KDA
    gate = "g" if config.kda_full_rank_gate else "g_a"  # the other kind is reported as unexpected
    if kda and (mm := re.fullmatch(rf"self_attn\.([qkv]|f_a|b|{gate})_proj\.weight", rest)):
        return [(prefix + "self_attn.in_proj.weight", mm.group(1), tensor_fn)]
    if kda and (mm := re.fullmatch(r"self_attn\.([qkv])_conv1d\.weight", rest)):
        return [(prefix + "self_attn.conv_weight", mm.group(1), tensor_fn)]
    if kda and rest == "self_attn.conv1d.weight":  # transformers: q|k|v stacked, [3P, 1, W]
        return [
            (prefix + "self_attn.conv_weight", s, lambda s=s: tensor_fn().chunk(3, dim=0)["qkv".index(s)])
            for s in "qkv"
        ]
    if mm := re.fullmatch(r"mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight", rest):
        return [(prefix + f"mlp.{mm.group(1) or ''}gate_up_proj.weight", _GLU[mm.group(2)], tensor_fn)]
    if mm := _EXPERT.fullmatch(rest):
        part, kind = _EXPERT_PART[mm.group(2)], mm.group(3)
        if int(mm.group(1)) >= config.num_experts:
            return [(name, None, tensor_fn)]  # no such expert: reported as unexpected
        param = prefix + ("mlp.experts.w2" if part == "w2" else "mlp.experts.w13")
        return [(param, (int(mm.group(1)), part), tensor_fn, kind)]
    if rest == "mlp.experts.gate_up_proj":
        return [(prefix + "mlp.experts.w13", (ALL_EXPERTS, "w13"), tensor_fn)]
    if rest == "mlp.experts.down_proj":
        return [(prefix + "mlp.experts.w2", (ALL_EXPERTS, "w2"), tensor_fn)]
    if config.mlp_types[layer] == MOE and rest == "mlp.gate.e_score_correction_bias":
        return [(name, None, tensor_fn)]
    return [(name, None, tensor_fn)]


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [path / f for f in names]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e!r})") from None
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise CheckpointError(f"{path}: shard(s) listed in the index are missing: {', '.join(absent)}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no safetensors weights (model.safetensors or an index)")
    return files


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated or corrupted headers
        raise CheckpointError(
            f"{file}: cannot read safetensors file ({e}); is it truncated or corrupted?"
        ) from None


def load_weights(model: KimiForCausalLM, path: str | Path) -> None:
    """Fill every parameter of `model` from the checkpoint folder `path`, or raise one CheckpointError."""
    path, config = Path(path), model.config
    params = dict(model.named_parameters())
    unexpected: list[str] = []
    mismatched: list[str] = []
    packed_halves: dict[tuple[str, tuple], tuple[str, dict[str, torch.Tensor]]] = {}
    tried: dict[str, set] = defaultdict(set)  # the shards of each parameter given a tensor, loaded or not

    def put(pname: str, shard, tensor: torch.Tensor, source: str):
        param = params.get(pname)
        if param is None:
            unexpected.append(source)
            return
        tried[pname].add(shard)  # a bad tensor is reported as unusable, not also as missing
        if tensor.dim() == 0:
            mismatched.append(f"{source}: checkpoint has a scalar, model expects {tuple(param.shape)}")
            return
        if not tensor.is_floating_point():
            mismatched.append(f"{source}: checkpoint has {tensor.dtype}, model expects floating point")
            return
        if tensor.element_size() == 1:  # FP8 (MXFP4's bytes arrive here already dequantized)
            mismatched.append(
                f"{source}: {tensor.dtype} without a scale (config.json has no quantization_config for it; "
                "upcast alone its values are wrong): save the checkpoint in bf16"
            )
            return
        if not _finite(tensor):
            mismatched.append(f"{source}: NaN or infinite values")
            return
        try:
            param.weight_loader(param, tensor, shard)
        except ShapeMismatch as e:
            mismatched.append(f"{source}: {e}")

    for file in checkpoint_files(path):
        f = _open(file)
        for name in f.keys():
            if name.startswith(_IGNORED_PREFIXES) or name.startswith(
                "language_model." + _IGNORED_PREFIXES[0]
            ):
                continue
            canonical = _canonical(name)
            if canonical is None or (config.tie_word_embeddings and canonical == "lm_head.weight"):
                if canonical is None:
                    unexpected.append(name)
                continue
            getter = _tensor_getter(f, name, file)
            for target in _targets(config, canonical, getter):
                pname, shard, get = target[0], target[1], target[2]
                kind = target[3] if len(target) > 3 else "weight"
                if kind == "weight":
                    put(pname, shard, get(), name)
                    continue
                base, halves = packed_halves.setdefault((pname, shard), (name.rsplit(".", 1)[0], {}))
                halves[kind] = get()
                if len(halves) == 2:  # MXFP4: both the packed nibbles and the E8M0 scales have arrived
                    del packed_halves[(pname, shard)]
                    tried[pname].add(shard)  # unusable halves are reported as such, not also as missing
                    try:
                        w = unpack_mxfp4(halves["weight_packed"], halves["weight_scale"], torch.float32)
                    except (ValueError, RuntimeError) as e:
                        mismatched.append(f"{name}: bad MXFP4 tensors ({e})")
                        continue
                    put(pname, shard, w, base)
    for base, halves in packed_halves.values():
        (have,) = halves
        lacks = "weight_scale" if have == "weight_packed" else "weight_packed"
        mismatched.append(f"{base}.{have}: MXFP4 tensor without its {base}.{lacks}")

    missing = []
    for pname, param in params.items():
        expected = set(param.expected_shards)
        got = tried.get(pname, set())
        if any(isinstance(s, tuple) and s[0] == ALL_EXPERTS for s in got):
            got = got | {s for s in expected if isinstance(s, tuple)}
        for shard in sorted(expected - got, key=str):
            missing.append(pname if shard is None else f"{pname} [{_shard_str(shard)}]")
    _raise_if_problems(path, missing, unexpected, mismatched)


def _finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity. A finite sum says so in one fast pass (NaN and infinity carry into any sum; isfinite
    on the CPU took ~20 s for mini's 3.3B weights, the sum under 1 s); only a sum that is not finite (or that
    overflowed) is checked value by value."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _tensor_getter(f, name: str, file: Path):
    def get() -> torch.Tensor:
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise CheckpointError(
                f"{file}: cannot read tensor {name} ({e}); is the file truncated?"
            ) from None

    return get


def _shard_str(shard) -> str:
    return f"expert {shard[0]} {shard[1]}" if isinstance(shard, tuple) else str(shard)


def _raise_if_problems(path: Path, missing: list, unexpected: list, mismatched: list) -> None:
    if not (missing or unexpected or mismatched):
        return

    def listing(title: str, items: list, limit: int = 12) -> str:
        shown = ", ".join(items[:limit]) + (
            f", ... ({len(items) - limit} more)" if len(items) > limit else ""
        )
        return f"{title} ({len(items)}): {shown}"

    parts = [
        listing(t, items)
        for t, items in (("missing", missing), ("unexpected", unexpected), ("unusable", mismatched))
        if items
    ]
    raise CheckpointError(f"checkpoint {path} does not match the model: " + "; ".join(parts))


# -- writing ------------------------------------------------------------------------------------------------


def export_tensors(model: KimiForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs in the layout of `model.config.model_type`."""
    if parallel_state().tp_size > 1:  # each parameter holds this rank's shard only
        raise CheckpointError("writing a checkpoint from a tensor-parallel shard is not supported")
    config = model.config
    k3 = config.model_type == "kimi_k3"
    top = "language_model." if k3 else ""
    moe_name = "block_sparse_moe"
    for name, param in model.named_parameters():
        t = param.detach()
        m = _LAYER.match(name)
        if m is None:
            yield top + name, t
            continue
        layer, rest = int(m.group(1)), m.group(2)
        p = f"{top}model.layers.{layer}."
        if rest == "self_attn.in_proj.weight":  # q | k | v | f_a | b | g or g_a, as separate tensors
            module = model.get_submodule(name.removesuffix(".weight"))
            for s, part in zip(module.shard_names, t.split(module.local_sizes, dim=0)):
                yield p + f"self_attn.{s}_proj.weight", part
        elif rest == "self_attn.conv_weight":
            for s, part in zip("qkv", t.chunk(3, dim=0)):
                yield p + f"self_attn.{s}_conv1d.weight", part.unsqueeze(1)  # [P, 1, W]
        elif rest == "self_attn.A_log":
            yield p + rest, t if k3 else t.view(1, 1, -1, 1)
        elif rest in ("mlp.gate_up_proj.weight", "mlp.shared_experts.gate_up_proj.weight"):
            base = rest.removesuffix("gate_up_proj.weight")
            if config.mlp_types[layer] == MOE:
                base = base.replace("mlp.", moe_name + ".", 1)
            gate, up = t.chunk(2, dim=0)
            yield p + base + "gate_proj.weight", gate
            yield p + base + "up_proj.weight", up
        elif rest.startswith("mlp.experts."):
            yield from _export_experts(p + moe_name + ".experts.", rest, t, config)
        elif rest.startswith("mlp.") and config.mlp_types[layer] == MOE:
            yield p + rest.replace("mlp.", moe_name + ".", 1), t
        else:
            yield p + rest, t


def _export_experts(prefix: str, rest: str, t: torch.Tensor, config: ModelConfig):
    for e in range(t.shape[0]):
        if rest == "mlp.experts.w13":
            parts = zip(("w1", "w3"), t[e].chunk(2, dim=0))
        else:
            parts = [("w2", t[e])]
        for part, w in parts:
            if config.experts_mxfp4:
                packed, scale = pack_mxfp4(w.float())
                yield prefix + f"{e}.{part}.weight_packed", packed
                yield prefix + f"{e}.{part}.weight_scale", scale
            else:
                yield prefix + f"{e}.{part}.weight", w


_KEEP_FP32 = ("A_log", "dt_bias", "gate.weight", "e_score_correction_bias")


def save_checkpoint(
    model: KimiForCausalLM,
    path: str | Path,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write config.json and the weights (one file, or shards + index when over `max_shard_bytes`).
    With `dtype`, floating tensors are stored in it, except the few that the model keeps in fp32."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
    tensors = {}
    for name, t in export_tensors(model):
        if dtype is not None and t.is_floating_point() and not name.endswith(_KEEP_FP32):
            t = t.to(dtype)
        tensors[name] = t.contiguous().cpu()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for stale in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        stale.unlink()
    if len(shards) == 1:
        _save(shards[0], path / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, path / fname)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _save(tensors: dict[str, torch.Tensor], file: Path) -> None:
    """safetensors' save_file, with the mode any file written here gets (safetensors leaves it 0600: a
    checkpoint saved for a server run by another user could not be read). The mode comes from an empty file
    opened first, as the process's umask makes it (os.umask would change it for every thread to read it)."""
    file.touch()
    mode = file.stat().st_mode & 0o777
    try:
        save_file(tensors, str(file), metadata={"format": "pt"})
    except BaseException:
        file.unlink(missing_ok=True)  # no empty file left to read as a truncated checkpoint
        raise
    os.chmod(file, mode)

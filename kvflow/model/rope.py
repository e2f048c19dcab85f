"""RoPE of Llama-family checkpoints: the rope types Llama and Qwen2 use, read from either
config.json convention, and their inverse frequencies.

Rope types (the math of transformers' ``modeling_rope_utils``, written here from the papers):

- ``default``: ``inv_freq[i] = theta^(-2i/d)``, d = head_dim (Su et al. 2021, RoFormer).
- ``linear``: ``inv_freq / factor`` (position interpolation, Chen et al. 2023).
- ``dynamic``: NTK-aware scaling (bloc97, emozilla 2023): the base grows with the sequence
  length once it passes ``max_position_embeddings``; below it is exactly ``default``. kvflow
  never runs a position at or past ``max_position_embeddings`` (the engine and the server
  refuse longer sequences), so ``default`` frequencies are exact for every token it computes.
- ``llama3``: Llama 3.1's per-frequency scaling: wavelengths above
  ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, those below
  ``.../high_freq_factor`` kept, a linear blend between.
- ``yarn``: YaRN (Peng et al. 2023): interpolated and extrapolated frequencies blended by a
  ramp over the dimensions between the ``beta_fast`` / ``beta_slow`` correction dims, and cos/sin
  multiplied by ``attention_factor`` (default ``0.1 ln(factor) + 1``, or the ratio of the
  ``mscale`` / ``mscale_all_dim`` terms when both are given).

config.json conventions: transformers >= 5 writes ``"rope_parameters": {"rope_theta": ...,
"rope_type": ..., ...}``; 4.x wrote a top-level ``rope_theta`` and ``"rope_scaling": {"type" or
"rope_type": ..., ...}``. Anything kvflow does not honour is refused, naming the field.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads where frequencies are computed: the config checks need none
    import torch

# Keys each rope type reads besides rope_type and rope_theta (the same as transformers).
ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast",
            "beta_slow", "mscale", "mscale_all_dim")


def rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` of a config.json (either convention).

    Returns
    -------
    rope_theta : float
        The base (10000.0 when the config names none, as transformers).
    rope_scaling : dict or None
        None for plain RoPE, else ``{"rope_type": ..., <the keys that type reads>}`` with
        ``original_max_position_embeddings`` filled (llama3, yarn) and yarn's ``factor`` of
        None resolved to ``max_position_embeddings / original_max_position_embeddings``.

    Raises
    ------
    ValueError
        Naming the field and value: a rope type kvflow does not implement, a key the type
        does not use, a missing or non-numeric parameter, ``partial_rotary_factor`` != 1,
        per-layer-type rope parameters, or two places of the config that disagree.
    """
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for name, v in (("rope_scaling", scaling), ("rope_parameters", params)):
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"config.json {name}={v!r} must be an object or null")
    if scaling and params:  # both written (by hand, or by tools that keep the old field)
        if _canonical(scaling) != _canonical(params):
            raise ValueError(f"config.json rope_scaling={scaling!r} and rope_parameters={params!r} "
                             "disagree; keep one")
        _one("rope_theta", params.get("rope_theta"), scaling.get("rope_theta"))
    p = {**(scaling or {}), **(params or {})}
    nested = sorted(k for k, v in p.items() if isinstance(v, dict))
    if nested:
        raise ValueError(f"config.json rope_parameters has per-layer-type entries {nested}; "
                         "kvflow uses one RoPE for every layer")
    rope_type = _one("rope_type", p.pop("rope_type", None), p.pop("type", None)) or "default"
    theta = _one("rope_theta", p.pop("rope_theta", None), cfg.get("rope_theta"))
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) \
            or theta <= 1:
        raise ValueError(f"config.json rope_theta={theta!r} must be a number > 1")
    prf = _one("partial_rotary_factor", p.pop("partial_rotary_factor", None),
               cfg.get("partial_rotary_factor"))
    if prf is not None and prf != 1:
        raise ValueError(f"config.json partial_rotary_factor={prf!r} is not supported: kvflow "
                         "rotates the whole head_dim (partial_rotary_factor 1)")
    if rope_type not in ROPE_KEYS:
        raise ValueError(f"config.json rope_type={rope_type!r} is not supported; kvflow "
                         f"implements {tuple(ROPE_KEYS)}")
    extra = sorted(set(p) - set(ROPE_KEYS[rope_type]))
    if extra:
        k = extra[0]
        raise ValueError(f"config.json rope parameter {k}={p[k]!r} is not used by rope_type "
                         f"{rope_type!r} (it reads {ROPE_KEYS[rope_type] or 'rope_theta only'}); "
                         "kvflow refuses what it does not honour")
    for k in _REQUIRED.get(rope_type, ()):
        if k not in p:
            raise ValueError(f"config.json rope_type={rope_type!r} needs rope parameter {k!r}")
    if rope_type in ("llama3", "yarn"):
        # transformers: a top-level original_max_position_embeddings overrides the rope one
        p["original_max_position_embeddings"] = _one(
            "original_max_position_embeddings", cfg.get("original_max_position_embeddings"),
            p.get("original_max_position_embeddings")) or cfg.get("max_position_embeddings")
        if rope_type == "yarn" and p["factor"] is None:
            p["factor"] = cfg["max_position_embeddings"] / p["original_max_position_embeddings"]
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **p}


def _canonical(d: dict) -> dict:
    """``d`` without rope_theta (compared on its own), its ``type`` read as ``rope_type``."""
    d = {k: v for k, v in d.items() if k != "rope_theta"}
    t = d.pop("type", None)
    d.setdefault("rope_type", t)
    return d


def _one(name, a, b):
    """``a`` or ``b`` (either may be None); two different values are refused."""
    if a is not None and b is not None and a != b:
        raise ValueError(f"config.json gives {name} twice with different values: {a!r} and {b!r}")
    return a if a is not None else b


def check_rope_scaling(rs: dict | None) -> None:
    """Validate a ``rope_scaling`` dict as :func:`rope_from_hf` returns it.

    Raises
    ------
    ValueError
        Unknown rope type, unknown or missing key, a parameter that is not a positive number
        (``factor`` must be >= 1, llama3's ``high_freq_factor`` > ``low_freq_factor``).
    """
    if rs is None:
        return
    t = rs.get("rope_type")
    if t not in ROPE_KEYS:
        raise ValueError(f"rope_scaling rope_type={t!r} is not supported; kvflow implements "
                         f"{tuple(ROPE_KEYS)}")
    keys = set(rs) - {"rope_type"}
    if keys - set(ROPE_KEYS[t]) or set(_REQUIRED.get(t, ())) - keys:
        raise ValueError(f"rope_scaling={rs!r}: rope_type {t!r} takes {ROPE_KEYS[t]} "
                         f"(required {_REQUIRED.get(t, ())})")
    for k in _REQUIRED.get(t, ()):
        if rs[k] is None:
            raise ValueError(f"rope_scaling {k}=None: rope_type {t!r} needs a number")
    for k in _NUMBERS:
        v = rs.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or v <= 0):
            raise ValueError(f"rope_scaling {k}={v!r} must be a positive finite number")
    if rs.get("factor", 1) < 1:
        raise ValueError(f"rope_scaling factor={rs['factor']!r} must be >= 1")
    if t == "llama3" and not rs["high_freq_factor"] > rs["low_freq_factor"]:
        raise ValueError(f"rope_scaling high_freq_factor={rs['high_freq_factor']!r} must exceed "
                         f"low_freq_factor={rs['low_freq_factor']!r}")
    omp = rs.get("original_max_position_embeddings", 1)
    if isinstance(omp, bool) or not isinstance(omp, int) or omp <= 0:
        raise ValueError(f"rope_scaling original_max_position_embeddings={omp!r} must be a "
                         "positive int")
    if "truncate" in rs and not isinstance(rs["truncate"], bool):
        raise ValueError(f"rope_scaling truncate={rs['truncate']!r} must be true or false")


def rope_frequencies(theta: float, rope_scaling: dict | None,
                     head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale of one RoPE.

    Parameters
    ----------
    theta : float
        RoPE base.
    rope_scaling : dict or None
        As :func:`rope_from_hf` returns it.
    head_dim : int
        Even; every dimension is rotated.

    Returns
    -------
    inv_freq : torch.Tensor
        float32 [head_dim // 2] (radians per position), computed in float32 as transformers.
    attention_scaling : float
        Factor on cos and sin (so on q.k twice): yarn's attention factor, else 1.0.
    """
    import torch

    d = head_dim
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    t = rope_scaling["rope_type"] if rope_scaling else "default"
    if t in ("default", "dynamic"):  # dynamic: see the module docstring
        return inv, 1.0
    rs = rope_scaling
    if t == "linear":
        return inv / rs["factor"], 1.0
    if t == "llama3":
        return _llama3(inv, rs), 1.0
    return _yarn(inv, rs, theta, d)


def _llama3(inv: torch.Tensor, rs: dict) -> torch.Tensor:
    import torch

    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old / lo, inv / factor, inv)
    return torch.where((wavelen >= old / hi) & (wavelen <= old / lo), blended, out)


def _yarn(inv: torch.Tensor, rs: dict, theta: float, d: int) -> tuple[torch.Tensor, float]:
    import torch

    factor, old = rs["factor"], rs["original_max_position_embeddings"]
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times in `old`
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency
    out = (inv / factor) * (1 - keep) + inv * keep
    attn = rs.get("attention_factor")
    if attn is None:
        ms, ms_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = _mscale(factor, ms) / _mscale(factor, ms_all) if ms and ms_all else _mscale(factor, 1)
    return out, float(attn)


def _mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

"""Tunix/Qwix LoRA parameters -> the Hugging Face tensors they change, and each delta in HF layout.

Every delta in HF (out, in) layout factors as `left @ right` with `left` (out, r) and `right`
(r, in), so a tensor's delta is produced block of rows by block of rows and never needs to exist
in full (derived from the Qwix factor shapes and the HF weight layout):

| tunix module: LoRA A, B           | HF tensor (out, in)   | left (out, r)      | right (r, in) |
|-----------------------------------|-----------------------|--------------------|---------------|
| q_einsum: (D,r), (r,N,H)          | q_proj (N*H, D)       | B.reshape(r,N*H).T | A.T           |
| kv_einsum: (D,r), (r,2,K,H)       | k_proj, v_proj (K*H,D)| B[:,c], likewise   | A.T (shared)  |
| k_einsum (global): (D,r), (r,K,H) | k_proj (K*H, D)       | B.reshape(r,K*H).T | A.T           |
| attn_vec_einsum: (N,H,r), (r,D)   | o_proj (D, N*H)       | B.T                | A~(N*H,r).T   |
| gate_proj, up_proj: (D,r), (r,F)  | mlp.*_proj (F, D)     | B.T                | A.T           |
| down_proj: (F,r), (r,D)           | mlp.down_proj (D, F)  | B.T                | A.T           |

(`A~(N*H,r)` is A reshaped; projections live under `self_attn.`.)
The scale alpha / rank is folded into `left`; both factors are row-major float32.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from workloads.common import errors
from workloads.merge import blas

# The text model's keys in a Gemma4ForConditionalGeneration checkpoint (what tunix loads).
HF_TEXT_PREFIX = "model.language_model."

# layers.<i>.<block>.<module>.<w|kernel>_lora_<a|b>
_PARAM_RE = re.compile(r"^layers\.(\d+)\.(attn|mlp)\.(\w+?)\.(?:w|kernel)_lora_([ab])$")


# Rows of a delta computed by one matrix product. A BLAS may round a row differently depending on
# the product it is part of (numpy's OpenBLAS computes small products, under about a million
# multiply-adds, with another kernel: measured here, a 128-row slice of a width-100, rank-64 delta
# alone rounds differently from the same rows inside a 512-row product) and on how many threads
# share the product, so a delta is always computed in these fixed blocks, counted from row 0, on
# one BLAS thread (blas.py): the whole tensor at once (`full`) and any streamed slice of it give
# the same bits, whatever block size the caller uses and whichever thread runs it.
ROW_BLOCK = 512

# Largest rank whose product `add_rows_to` accumulates straight into the base rows (GEMM with
# beta = 1). OpenBLAS sums the whole inner dimension of a product in registers when it fits one of
# its K panels (GEMM_Q, several hundred on its x86 kernels), then adds C once: fl(C + fl(sum)), the
# same bits as adding the finished delta (tested up to this rank). A larger rank could be summed
# panel by panel into C, which would round differently, so it takes the separate add.
FUSED_ADD_MAX_RANK = 128


@dataclasses.dataclass(frozen=True)
class Delta:
    """The LoRA update of one HF tensor: `left @ right`, shape (rows, cols), float32.

    Every product is one single-threaded sgemm of numpy's OpenBLAS per block of `row_block` rows:
    numpy's matmul in `rows` (the naive whole-tensor merge uses it), the same cblas call with
    beta = 1 in `add_rows_to` (the streamed merge), so the two give the same bits.

    Attributes:
        hf_name: the tensor it is added to.
        left: (rows, r) float32, alpha / rank already folded in.
        right: (r, cols) float32.
        source: the tunix LoRA module it comes from (for error messages).
        row_block: rows per matrix product (ROW_BLOCK; tests use small ones to get many blocks).
    """

    hf_name: str
    left: np.ndarray
    right: np.ndarray
    source: str
    row_block: int = ROW_BLOCK

    def __post_init__(self) -> None:
        # Row-major float32 factors once, as the BLAS call of add_rows_to needs them (the
        # mapping's transposes are views; copies here cost each factor once, then the views are
        # freed), and as numpy's matmul would otherwise copy them for every block.
        for name in ("left", "right"):
            value = getattr(self, name)
            object.__setattr__(self, name, np.ascontiguousarray(value, dtype=np.float32))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.left.shape[0], self.right.shape[1])

    def _check_aligned(self, start: int, stop: int) -> None:
        if start % self.row_block or (stop % self.row_block and stop != self.shape[0]):
            raise ValueError(
                f"{self.hf_name}: rows [{start}, {stop}) are not aligned to blocks of "
                f"{self.row_block} rows"
            )

    def rows(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of the delta, float32 (into `out` when given), computed block by
        block of `row_block` rows, so the bits do not depend on how the caller slices the tensor.

        Raises:
            ValueError: `start` (or `stop`, unless it is the last row) is not a multiple of
                `row_block`.
        """
        self._check_aligned(start, stop)
        if out is None:
            out = np.empty((stop - start, self.shape[1]), np.float32)
        with blas.single_threaded():
            for begin in range(start, stop, self.row_block):
                end = min(begin + self.row_block, stop)
                np.matmul(self.left[begin:end], self.right, out=out[begin - start : end - start])
        return out

    def add_rows_to(self, base: np.ndarray, start: int) -> np.ndarray:
        """base += rows [start, start + len(base)) of the delta, in place, float32: the same bits
        as `base + self.rows(...)` with one pass over `base` fewer (the product is accumulated
        into it; ranks above FUSED_ADD_MAX_RANK add the finished delta instead).

        Raises:
            ValueError: the rows are not aligned to `row_block` (see `rows`).
        """
        stop = start + base.shape[0]
        self._check_aligned(start, stop)
        fused = (
            self.left.shape[1] <= FUSED_ADD_MAX_RANK
            and base.dtype == np.float32
            and base.flags.c_contiguous
            and blas.has_sgemm()
        )
        if not fused:
            base += self.rows(start, stop)
            return base
        with blas.single_threaded():
            for begin in range(start, stop, self.row_block):
                end = min(begin + self.row_block, stop)
                rows = base[begin - start : end - start]
                if end - begin == 1 or self.shape[1] == 1:
                    # numpy's matmul computes a one-row or one-column product as a
                    # matrix-vector product (gemv), which rounds differently from a gemm.
                    rows += np.matmul(self.left[begin:end], self.right)
                else:
                    blas.sgemm_accumulate(self.left[begin:end], self.right, rows)
        return base

    def full(self) -> np.ndarray:
        return self.rows(0, self.shape[0])

    @functools.cached_property
    def _row_bounds(self) -> np.ndarray:
        """Per row i: |left_i| * max_j |right[:, j]| (Euclidean norms, float64 so that garbage
        factors do not overflow), by Cauchy-Schwarz at least max_j |delta[i, j]|."""
        left = self.left.astype(np.float64)
        right = self.right.astype(np.float64)
        columns = float(np.sqrt((right * right).sum(axis=0)).max()) if right.size else 0.0
        return np.sqrt((left * left).sum(axis=1)) * columns

    def magnitude_bound(self, start: int, stop: int) -> float:
        """An upper bound of max |delta| over rows [start, stop), from the factors alone (no
        product): what the merge compares with the merged values it already has."""
        rows = self._row_bounds[start:stop]
        return float(rows.max()) if rows.size else 0.0


# One rule per tunix module: (A, B) float32 -> [(HF suffix under layers.<i>., left, right)].
Rule = Callable[[np.ndarray, np.ndarray], list[tuple[str, np.ndarray, np.ndarray]]]


def _heads_out(b: np.ndarray) -> np.ndarray:
    """B (r, heads..., H) -> left (heads*H, r)."""
    return b.reshape(b.shape[0], -1).T


def _q(a: np.ndarray, b: np.ndarray) -> list[tuple[str, np.ndarray, np.ndarray]]:
    return [("self_attn.q_proj.weight", _heads_out(b), a.T)]


def _kv(a: np.ndarray, b: np.ndarray) -> list[tuple[str, np.ndarray, np.ndarray]]:
    if b.ndim != 4 or b.shape[1] != 2:
        raise ValueError(f"kv_einsum LoRA B must be (r, 2, K, H), got {b.shape}")
    return [
        ("self_attn.k_proj.weight", _heads_out(b[:, 0]), a.T),
        ("self_attn.v_proj.weight", _heads_out(b[:, 1]), a.T),
    ]


def _k(a: np.ndarray, b: np.ndarray) -> list[tuple[str, np.ndarray, np.ndarray]]:
    return [("self_attn.k_proj.weight", _heads_out(b), a.T)]


def _o(a: np.ndarray, b: np.ndarray) -> list[tuple[str, np.ndarray, np.ndarray]]:
    return [("self_attn.o_proj.weight", b.T, a.reshape(-1, a.shape[-1]).T)]


def _linear(hf_suffix: str) -> Rule:
    def rule(a: np.ndarray, b: np.ndarray) -> list[tuple[str, np.ndarray, np.ndarray]]:
        return [(hf_suffix, b.T, a.T)]

    return rule


RULES: dict[str, Rule] = {
    "q_einsum": _q,
    "kv_einsum": _kv,
    "k_einsum": _k,
    "attn_vec_einsum": _o,
    "gate_proj": _linear("mlp.gate_proj.weight"),
    "up_proj": _linear("mlp.up_proj.weight"),
    "down_proj": _linear("mlp.down_proj.weight"),
}


def _f32(x: np.ndarray) -> np.ndarray:
    """float32 without a copy when it already is (a transposed view is fine for BLAS)."""
    return np.asarray(x, dtype=np.float32)


def group_modules(params: Mapping[str, np.ndarray]) -> dict[tuple[int, str], dict[str, str]]:
    """Groups flat LoRA param names into modules: (layer, module) -> {"a": name, "b": name}.

    Raises:
        errors.UserError: a parameter that is not a layer's LoRA factor, or a module missing A or B.
    """
    modules: dict[tuple[int, str], dict[str, str]] = {}
    for name in params:
        match = _PARAM_RE.match(name)
        if not match:
            raise errors.UserError(
                f"LoRA parameter {name!r} has no Hugging Face mapping (expected "
                "layers.<i>.attn|mlp.<module>.w|kernel_lora_a|b)"
            )
        layer, _, module, which = match.groups()
        modules.setdefault((int(layer), module), {})[which] = name
    for (layer, module), pair in modules.items():
        if set(pair) != {"a", "b"}:
            missing = ({"a", "b"} - set(pair)).pop()
            raise errors.UserError(
                f"LoRA module layers.{layer}.{module} has no lora_{missing} factor"
            )
    return modules


def targets_without_factors(params: Mapping[str, np.ndarray], targets: Iterable[str]) -> list[str]:
    """One line per target of lora_meta.json for which the checkpoint holds no LoRA factor in
    any layer: such a target changes nothing in the merge (a model without that module, or
    metadata that does not describe these adapters), which the user should know.

    Raises:
        errors.UserError: a parameter that is not a layer's LoRA factor (see group_modules).
    """
    present = {module for _, module in group_modules(params)}
    return [
        f"lora_meta.json targets {target} but the checkpoint holds no LoRA factors for it in "
        "any layer; the merge leaves those weights as in the base"
        for target in sorted(set(targets) - present)
    ]


def build_deltas(
    params: Mapping[str, np.ndarray],
    *,
    rank: int,
    alpha: float,
    targets: Iterable[str],
    prefix: str = HF_TEXT_PREFIX,
    rules: Mapping[str, Rule] = RULES,
) -> dict[str, Delta]:
    """Turns restored LoRA factors into the deltas of the HF tensors they change.

    Args:
        params: flat LoRA params, `layers.<i>.<attn|mlp>.<module>.<w|kernel>_lora_<a|b>` -> array.
        rank, alpha, targets: from the checkpoint's lora_meta.json.
        prefix: key prefix of the text model in the HF checkpoint.
        rules: the per-module mapping (tests inject corrupted ones as negative controls).

    Returns:
        HF tensor name -> Delta.

    Raises:
        errors.UserError: a module the metadata does not list as a target, a module with no known
            mapping, a factor whose rank differs from the metadata's, or inconsistent factor shapes.
    """
    targets = set(targets)
    scale = np.float32(alpha / rank)
    deltas: dict[str, Delta] = {}
    for (layer, module), pair in sorted(group_modules(params).items()):
        source = f"layers.{layer}.{module}"
        if module not in rules:
            raise errors.UserError(
                f"LoRA module {source} has no Hugging Face mapping (known: {', '.join(rules)})"
            )
        if module not in targets:
            raise errors.UserError(
                f"checkpoint has LoRA on {source} but lora_meta.json targets are "
                f"{', '.join(sorted(targets))}"
            )
        a, b = params[pair["a"]], params[pair["b"]]
        if a.shape[-1] != rank or b.shape[0] != rank:
            raise errors.UserError(
                f"{source}: LoRA factors A {tuple(a.shape)} / B {tuple(b.shape)} have rank "
                f"{a.shape[-1]}/{b.shape[0]} but lora_meta.json says rank {rank}"
            )
        try:
            produced = rules[module](_f32(a), _f32(b))
        except ValueError as exc:
            raise errors.UserError(f"{source}: {exc}") from None
        for suffix, left, right in produced:
            hf_name = f"{prefix}layers.{layer}.{suffix}"
            if hf_name in deltas:
                raise errors.UserError(
                    f"{source} and {deltas[hf_name].source} both change {hf_name}"
                )
            if scale != 1:
                left = left * scale
            deltas[hf_name] = Delta(hf_name, _f32(left), _f32(right), source)
    return deltas

"""The Tunix -> HF delta mapping against independently written einsum formulas (numpy)."""

import dataclasses

import numpy as np
import pytest

from workloads.common import errors
from workloads.merge import mapping

D, R, N, K, KG, H, HG, F = 12, 3, 4, 2, 1, 5, 10, 7
P = mapping.HF_TEXT_PREFIX


def factors(seed=0, **shapes):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def lora_params(layer, block, module, a, b, kind="w"):
    return {
        f"layers.{layer}.{block}.{module}.{kind}_lora_a": a,
        f"layers.{layer}.{block}.{module}.{kind}_lora_b": b,
    }


def deltas(params, targets, alpha=6.0):
    return {
        k: d.full()
        for k, d in mapping.build_deltas(params, rank=R, alpha=alpha, targets=targets).items()
    }


def test_q_is_einsum_Dr_rNH_to_NHD():
    f = factors(a=(D, R), b=(R, N, H))
    got = deltas(lora_params(0, "attn", "q_einsum", f["a"], f["b"]), ["q_einsum"])
    want = 2.0 * np.einsum("Dr,rNH->NHD", f["a"], f["b"]).reshape(N * H, D)
    np.testing.assert_allclose(
        got[f"{P}layers.0.self_attn.q_proj.weight"], want, rtol=1e-5, atol=1e-6
    )


def test_kv_splits_into_k_and_v_with_shared_a():
    f = factors(a=(D, R), b=(R, 2, K, H))
    got = deltas(lora_params(2, "attn", "kv_einsum", f["a"], f["b"]), ["kv_einsum"])
    full = 2.0 * np.einsum("Dr,rCKH->CKHD", f["a"], f["b"])
    np.testing.assert_allclose(
        got[f"{P}layers.2.self_attn.k_proj.weight"], full[0].reshape(K * H, D), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        got[f"{P}layers.2.self_attn.v_proj.weight"], full[1].reshape(K * H, D), rtol=1e-5, atol=1e-6
    )


def test_global_k_einsum_is_k_proj_only():
    f = factors(a=(D, R), b=(R, KG, HG))
    got = deltas(lora_params(5, "attn", "k_einsum", f["a"], f["b"]), ["k_einsum"])
    assert set(got) == {f"{P}layers.5.self_attn.k_proj.weight"}
    want = 2.0 * np.einsum("Dr,rKH->KHD", f["a"], f["b"]).reshape(KG * HG, D)
    np.testing.assert_allclose(
        got[f"{P}layers.5.self_attn.k_proj.weight"], want, rtol=1e-5, atol=1e-6
    )


def test_attn_vec_is_transposed_into_o_proj():
    f = factors(a=(N, H, R), b=(R, D))
    got = deltas(lora_params(1, "attn", "attn_vec_einsum", f["a"], f["b"]), ["attn_vec_einsum"])
    want = 2.0 * np.einsum("NHr,rD->NHD", f["a"], f["b"]).reshape(N * H, D).T
    np.testing.assert_allclose(
        got[f"{P}layers.1.self_attn.o_proj.weight"], want, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    ("module", "a_shape", "b_shape"),
    [("gate_proj", (D, R), (R, F)), ("up_proj", (D, R), (R, F)), ("down_proj", (F, R), (R, D))],
)
def test_mlp_is_transposed_product(module, a_shape, b_shape):
    f = factors(a=a_shape, b=b_shape)
    got = deltas(lora_params(0, "mlp", module, f["a"], f["b"], kind="kernel"), [module])
    np.testing.assert_allclose(
        got[f"{P}layers.0.mlp.{module}.weight"], 2.0 * (f["a"] @ f["b"]).T, rtol=1e-5, atol=1e-6
    )


def test_rows_in_blocks_equal_the_full_delta():
    f = factors(a=(D, R), b=(R, N, H))
    (delta,) = mapping.build_deltas(
        lora_params(0, "attn", "q_einsum", f["a"], f["b"]), rank=R, alpha=R, targets=["q_einsum"]
    ).values()
    delta = dataclasses.replace(delta, row_block=3)  # N*H = 16 rows: blocks of 3, then 1
    for step in (3, 6, 15):
        blocks = [delta.rows(i, min(i + step, N * H)) for i in range(0, N * H, step)]
        assert np.concatenate(blocks).tobytes() == delta.full().tobytes()


def test_rows_not_aligned_to_the_delta_blocks_are_refused():
    f = factors(a=(D, R), b=(R, N, H))
    (delta,) = mapping.build_deltas(
        lora_params(0, "attn", "q_einsum", f["a"], f["b"]), rank=R, alpha=R, targets=["q_einsum"]
    ).values()
    delta = dataclasses.replace(delta, row_block=4)
    with pytest.raises(ValueError, match=r"rows \[2, 8\) are not aligned to blocks of 4 rows"):
        delta.rows(2, 8)
    with pytest.raises(ValueError, match="not aligned"):
        delta.rows(0, 6)
    assert delta.rows(12, N * H).shape == (N * H - 12, delta.shape[1])  # the last block is short


def test_bf16_factors_are_computed_in_float32():
    import ml_dtypes

    f = factors(a=(D, R), b=(R, F))
    params = lora_params(
        0,
        "mlp",
        "up_proj",
        f["a"].astype(ml_dtypes.bfloat16),
        f["b"].astype(ml_dtypes.bfloat16),
        "kernel",
    )
    (delta,) = mapping.build_deltas(params, rank=R, alpha=R, targets=["up_proj"]).values()
    assert delta.full().dtype == np.float32


@pytest.mark.parametrize(
    ("rank", "targets", "message"),
    [
        (R, ["q_einsum"], r"layers\.0\.q_einsum.*rank 4/4 but lora_meta.json says rank 3"),
        (R + 1, ["up_proj"], r"LoRA on layers\.0\.q_einsum but lora_meta.json targets are up_proj"),
    ],
)
def test_rank_or_targets_differing_from_metadata_name_the_module(rank, targets, message):
    f = factors(a=(D, R + 1), b=(R + 1, N, H))
    params = lora_params(0, "attn", "q_einsum", f["a"], f["b"])
    with pytest.raises(errors.UserError, match=message):
        mapping.build_deltas(params, rank=rank, alpha=1.0, targets=targets)


def test_unknown_parameter_and_missing_factor_are_refused():
    with pytest.raises(
        errors.UserError, match=r"embedder\.input_embedding_lora_a.*no Hugging Face mapping"
    ):
        mapping.build_deltas(
            {"embedder.input_embedding_lora_a": np.zeros((2, R))}, rank=R, alpha=1.0, targets=[]
        )
    with pytest.raises(errors.UserError, match=r"layers\.0\.q_einsum has no lora_b"):
        mapping.build_deltas(
            {"layers.0.attn.q_einsum.w_lora_a": np.zeros((D, R))},
            rank=R,
            alpha=1.0,
            targets=["q_einsum"],
        )


def test_a_target_without_factors_in_any_layer_is_noted_in_one_line():
    f = factors(a=(D, R), b=(R, N, H))
    params = lora_params(0, "attn", "q_einsum", f["a"], f["b"])
    assert mapping.targets_without_factors(params, ["q_einsum"]) == []
    (note,) = mapping.targets_without_factors(params, ["q_einsum", "down_proj"])
    assert note == (
        "lora_meta.json targets down_proj but the checkpoint holds no LoRA factors for it in any "
        "layer; the merge leaves those weights as in the base"
    )


@pytest.mark.parametrize("rank", [16, 64, mapping.FUSED_ADD_MAX_RANK, 192])
def test_the_product_accumulated_into_the_base_equals_adding_the_finished_delta(rank):
    """add_rows_to (one BLAS call with beta = 1, one pass less) gives the bits of base + rows()
    at the 31B model's widths, for the mapping's transposed (non-contiguous) factors, a short last
    block and a start past row 0; rank 192 takes the separate add."""
    rng = np.random.default_rng(rank)
    rows, cols = 2 * mapping.ROW_BLOCK + 37, 5376
    b = rng.standard_normal((rank, rows), dtype=np.float32) * 0.01  # B (r, F): left = B.T
    a = rng.standard_normal((cols, rank), dtype=np.float32) / 64  # A (D, r): right = A.T
    delta = mapping.Delta("w", b.T, a.T, "layers.0.mlp.up_proj")
    base = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
    for start, stop in ((0, rows), (mapping.ROW_BLOCK, rows), (0, mapping.ROW_BLOCK)):
        expected = base[start:stop] + delta.rows(start, stop)
        got = delta.add_rows_to(base[start:stop].copy(), start)
        assert got.tobytes() == expected.tobytes()
    with pytest.raises(ValueError, match="not aligned"):
        delta.add_rows_to(base[:10].copy(), 3)


@pytest.mark.parametrize(("rows", "cols"), [(2 * mapping.ROW_BLOCK + 1, 300), (700, 1), (1, 1)])
def test_one_row_or_one_column_blocks_match_numpy_s_matrix_vector_product(rows, cols):
    """numpy computes a one-row (or one-column) product as gemv, which rounds differently from
    gemm: such blocks take numpy's product, so the merge still matches the naive one."""
    rng = np.random.default_rng(rows + cols)
    delta = mapping.Delta(
        "w",
        rng.standard_normal((rows, 64), dtype=np.float32),
        rng.standard_normal((64, cols), dtype=np.float32),
        "layers.0.mlp.up_proj",
    )
    base = rng.standard_normal((rows, cols), dtype=np.float32)
    expected = base + delta.full()
    assert delta.add_rows_to(base.copy(), 0).tobytes() == expected.tobytes()


def test_the_delta_is_the_float32_product_of_the_factors():
    """The BLAS products against float64 (a wrong operand order or transpose would be far off)."""
    rng = np.random.default_rng(1)
    left = rng.standard_normal((700, 8), dtype=np.float32)
    right = rng.standard_normal((8, 300), dtype=np.float32)
    delta = mapping.Delta("w", left, right, "layers.0.mlp.up_proj")
    exact = left.astype(np.float64) @ right.astype(np.float64)
    np.testing.assert_allclose(delta.full(), exact, rtol=1e-5, atol=1e-5)
    base = rng.standard_normal((700, 300), dtype=np.float32)
    summed = delta.add_rows_to(base.copy(), 0)
    np.testing.assert_allclose(summed, base + exact, rtol=1e-5, atol=1e-5)

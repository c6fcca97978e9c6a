"""The engine's lean forward pass computes transformers' function: logits and KV on the engine's batch layouts."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config, Qwen3Config

from agentgym.inference import decoder as decoder_module
from agentgym.inference import weights as weights_module
from agentgym.inference.decoder import LeanDecoder
from agentgym.inference.engine import Engine
from agentgym.inference.kv import GrowingLayer
from agentgym.inference.models import tiny_model_dir
from agentgym.inference.sampling import SamplingParams
from agentgym.inference.weights import cache_argument, cpu_matmul_dtype


def growing_cache(model: Any) -> Any:
    cache = DynamicCache(config=model.config)
    for index in range(len(cache.layers)):
        cache.layers[index] = GrowingLayer()
    return cache


def hf_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_argument(model): cache},
    )
    return out.logits[:, -1].float()


def tiny_llama() -> Any:
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir()), dtype=torch.float32).eval()


SMALL_SHAPE: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""A small decoder with grouped KV heads (2 query heads per KV head)."""


def tiny_qwen2() -> Any:
    """Qwen2's shape: biases on q/k/v, untied head, grouped KV heads."""
    torch.manual_seed(0)
    config = Qwen2Config(**SMALL_SHAPE, max_position_embeddings=256, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # non-zero biases, so that a dropped bias shows
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_(0, 0.5)
    return model


def left_padded(lengths: list[int], vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


@pytest.fixture
def share_everything(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A `ForwardHelper` that every projection, attention and MLP of the tests' small models is shared with."""
    monkeypatch.setattr(decoder_module, "SHARED_PRODUCT_MACS", 0)
    monkeypatch.setattr(decoder_module, "SHARED_ATTENTION_MACS", 0)
    monkeypatch.setattr(decoder_module, "SHARED_MLP_MACS", 0)
    monkeypatch.setattr(decoder_module, "SHARED_PACKED_MACS", 0)
    helper = decoder_module.ForwardHelper()
    yield helper
    helper.close()


@pytest.mark.parametrize("shared", [False, True], ids=["one-thread", "shared"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_prefill_decode_and_a_prefix_hit_chunk_match_transformers(build: Any, shared: bool, request: Any) -> None:
    model = build()
    helper = request.getfixturevalue("share_everything") if shared else None
    lean = LeanDecoder.for_model(model, helper=helper)
    assert lean is not None
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(1)
    ours, theirs = growing_cache(model), growing_cache(model)
    with torch.inference_mode():
        # A left-padded prefill of three prompts.
        ids, mask, positions = left_padded([5, 9, 2], vocab, generator)
        torch.testing.assert_close(
            lean.forward(ids, mask, positions, ours), hf_logits(model, ids, mask, positions, theirs)
        )
        lengths = mask.sum(-1)
        # Decode steps: one new column a step.
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
            step = torch.randint(3, vocab, (3, 1), generator=generator)
            expected = hf_logits(model, step, mask, lengths[:, None], theirs)
            torch.testing.assert_close(lean.forward(step, mask, lengths[:, None], ours), expected)
            lengths = lengths + 1
        # The next turn's chunk after cached KV: rows with shorter suffixes have padding between past and new.
        suffix = torch.tensor([4, 2, 3])
        new = int(suffix.max())
        chunk_mask = torch.zeros(3, new, dtype=mask.dtype)
        for row, length in enumerate(suffix.tolist()):
            chunk_mask[row, new - length :] = 1
        mask = torch.cat([mask, chunk_mask], dim=1)
        positions = lengths[:, None] + (chunk_mask.cumsum(-1) - 1).clamp(min=0)
        chunk = torch.randint(3, vocab, (3, new), generator=generator)
        expected = hf_logits(model, chunk, mask, positions, theirs)
        torch.testing.assert_close(lean.forward(chunk, mask, positions, ours), expected)
    if helper is not None:  # 5 forwards x layers x (q/k/v and o projections, attention, the MLP) + the head's
        assert helper._generation >= 5 * 4 * len(lean.layers)
    # The KV both wrote agree on every real column.
    real = mask[:, None, :, None].bool()
    for mine, reference in zip(ours.layers, theirs.layers, strict=True):
        torch.testing.assert_close(mine.keys * real, reference.keys * real)
        torch.testing.assert_close(mine.values * real, reference.values * real)


def test_fused_projections_share_the_models_storage() -> None:
    model = tiny_llama()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    lean = LeanDecoder.for_model(model)
    assert lean is not None
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.weight.data_ptr() == lean.layers[0].qkv[attention.q_proj.weight.shape[0] :].data_ptr()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_models_of_another_shape_keep_transformers_forward() -> None:
    config = Qwen3Config(**SMALL_SHAPE, head_dim=16)
    qwen3 = AutoModelForCausalLM.from_config(config).eval()  # q/k norms: not the plain Llama shape
    assert LeanDecoder.for_model(qwen3) is None
    qwen2 = tiny_qwen2()
    qwen2.config.use_sliding_window, qwen2.config.sliding_window = True, 16
    assert LeanDecoder.for_model(qwen2) is None


async def _greedy(engine: Engine) -> list[list[int]]:
    import asyncio

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [list(range(10, 40)), list(range(50, 55)), list(range(60, 100))]
    outputs = await asyncio.gather(*(engine.generate(prompt, params) for prompt in prompts))
    return [output.samples[0].token_ids for output in outputs]


def test_the_engine_generates_the_same_tokens_with_either_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    results = {}
    for lean in ("1", "0"):
        monkeypatch.setenv("AGENTGYM_LEAN_DECODER", lean)
        engine = Engine(tiny_model_dir(), device="cpu", max_batch_size=4)
        try:
            assert (engine._lean is not None) == (lean == "1")
            results[lean] = asyncio.run(_greedy(engine))
        finally:
            engine.close()
    assert results["1"] == results["0"]


@pytest.mark.parametrize("attention", ["bf16", "float32"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama-tied-head", "qwen2-biases"])
def test_bf16_matmuls_compute_what_the_trainers_autocast_computes(
    build: Any, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 matmuls over float32 norms, RoPE, residual stream and logits: transformers' forward under CPU bf16
    autocast (the trainer's bf16) to float rounding, much closer to it than either is to float32; a prefill and
    a decode step. With attention in float32 (`attention_in_float32`, by CPU), what autocast computes when its
    attention is the same formula in float32 over the same bf16-rounded inputs, rounded to bf16 after it."""
    monkeypatch.setattr(decoder_module, "attention_in_float32", lambda *shape: attention == "float32")
    bf16_attention = F.scaled_dot_product_attention

    def float32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            query, key, value = (tensor.bfloat16().float() for tensor in (q, k, v))
            return bf16_attention(query, key, value, *args, **kw).bfloat16()

    model = build()
    reference = build()  # float32 weights: the lean pass converts `model`'s projections in place
    lean = LeanDecoder.for_model(model, torch.bfloat16)
    assert lean is not None and lean.attention_in_float32 == (attention == "float32")
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(2)
    ids, mask, positions = left_padded([7, 12, 3], vocab, generator)
    step_mask, step_positions = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1), positions[:, -1:] + 1
    step = torch.tensor([[5], [9], [11]])
    with torch.inference_mode():
        cache = growing_cache(model)
        ours = [lean.forward(ids, mask, positions, cache), lean.forward(step, step_mask, step_positions, cache)]
        theirs: dict[bool, list[torch.Tensor]] = {}
        for autocast in (True, False):
            cache = growing_cache(reference)
            if autocast and attention == "float32":  # transformers' forward looks it up in torch's module
                monkeypatch.setattr(F, "scaled_dot_product_attention", float32_attention)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                theirs[autocast] = [
                    hf_logits(reference, ids, mask, positions, cache),
                    hf_logits(reference, step, step_mask, step_positions, cache),
                ]
            monkeypatch.setattr(F, "scaled_dot_product_attention", bf16_attention)
    for mine, under_autocast, full in zip(ours, theirs[True], theirs[False], strict=True):
        gap = (mine - under_autocast).abs().max().item()
        assert mine.dtype == torch.float32 and gap <= 0.25 * (full - under_autocast).abs().max().item(), gap
    # The projections now hold bf16; the embedding (and so a tied head's source) stays float32.
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert lean.lm_head.dtype == torch.bfloat16 and model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.skipif(not decoder_module._onednn_bf16(), reason="oneDNN has no native bf16 matmul on this CPU")
@pytest.mark.parametrize("shared", [False, True], ids=["one-thread", "shared-by-rows"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen2], ids=["llama-tied-head", "qwen2-biases"])
def test_packed_bf16_matrices_give_the_plain_bf16_logits(
    build: Any, shared: bool, monkeypatch: pytest.MonkeyPatch, request: Any
) -> None:
    """oneDNN's blocked layout changes where the matrices' numbers sit, not the products: prefill (left-padded
    rows) and a decode step give the logits and KV of plain bf16 matrices, on one thread or with every product
    shared with a helper by chunks of rows."""
    packed_model, plain_model = build(), build()
    helper = request.getfixturevalue("share_everything") if shared else None
    packed = LeanDecoder.for_model(packed_model, torch.bfloat16, helper)
    monkeypatch.setattr(decoder_module, "_onednn_bf16", lambda: False)
    plain = LeanDecoder.for_model(plain_model, torch.bfloat16)
    assert packed is not None and plain is not None
    assert packed.layers[0].qkv.is_mkldnn and packed.lm_head.is_mkldnn and not plain.layers[0].qkv.is_mkldnn
    # The packed matrices are the only copy: the model's projections (and an untied head) are on the meta device.
    assert packed_model.model.layers[0].mlp.down_proj.weight.is_meta
    assert not plain_model.model.layers[0].mlp.down_proj.weight.is_meta
    tied = bool(packed_model.config.tie_word_embeddings)
    assert packed_model.lm_head.weight.is_meta == (not tied) and not packed_model.model.embed_tokens.weight.is_meta
    vocab = int(packed_model.config.vocab_size)
    ids, mask, positions = left_padded([7, 12, 3], vocab, torch.Generator().manual_seed(4))
    caches = growing_cache(packed_model), growing_cache(plain_model)
    with torch.inference_mode():
        logits = [
            lean.forward(ids, mask, positions, cache) for lean, cache in zip((packed, plain), caches, strict=True)
        ]
        torch.testing.assert_close(logits[0], logits[1], atol=1e-2, rtol=0)
        step = torch.tensor([[5], [9], [11]])
        mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
        position = positions[:, -1:] + 1
        logits = [
            lean.forward(step, mask, position, cache) for lean, cache in zip((packed, plain), caches, strict=True)
        ]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-2, rtol=0)
    torch.testing.assert_close(caches[0].layers[1].keys, caches[1].layers[1].keys, atol=1e-2, rtol=0)
    if helper is not None:  # 2 forwards x layers x (q/k/v and o by rows, attention, the MLP by rows) + the head's
        assert helper._generation >= 2 * 4 * len(packed.layers)


def test_bfloat16_means_bf16_matmuls_only_on_a_cpu_with_bf16_units(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(weights_module, "cpu_has_bf16_units", lambda: True)
    assert cpu_matmul_dtype(cpu, "bfloat16") == torch.bfloat16
    assert cpu_matmul_dtype(cpu, "float32") is None and cpu_matmul_dtype(cpu, None) is None
    assert cpu_matmul_dtype(torch.device("cuda"), "bfloat16") is None  # GPUs: bf16 parameters (pick_dtype)
    monkeypatch.setattr(weights_module, "cpu_has_bf16_units", lambda: False)  # emulated bf16: float32
    assert cpu_matmul_dtype(cpu, "bfloat16") is None


def test_a_bf16_engine_samples_with_autocasts_logprobs_and_caches_in_its_attentions_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    monkeypatch.setattr(weights_module, "cpu_has_bf16_units", lambda: True)  # the bf16 path on any CPU
    engines = {dtype: Engine(tiny_model_dir(), device="cpu", dtype=dtype, max_batch_size=4) for dtype in DTYPES}
    try:
        assert engines["bfloat16"].matmul_dtype == torch.bfloat16 and engines["float32"].matmul_dtype is None
        # KV is kept in bf16 (the same prefix-cache bytes hold twice the tokens) unless attention is in float32.
        lean = engines["bfloat16"]._lean
        assert lean is not None and lean.kv_dtype == (torch.float32 if lean.attention_in_float32 else torch.bfloat16)
        tokens = engines["float32"].prefix_cache_tokens * (1 if lean.attention_in_float32 else 2)
        assert engines["bfloat16"].prefix_cache_tokens == tokens
        prompt = list(range(10, 40))
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        sample = asyncio.run(engines["bfloat16"].generate(prompt, params)).samples[0]
    finally:
        for engine in engines.values():
            engine.close()
    # Its logprobs are the trainer's: transformers' forward under bf16 autocast over the same ids.
    reference = tiny_llama()
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = reference(input_ids=ids).logits.float()
    scored = logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(scored, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
    # Both sides round every matmul's output to bf16, the logits included, so where their kernels sum in another
    # order (AVX2 vs AMX, packed vs plain) a logit can land a bf16 step away, two with one carried from the layers
    # below. A log-prob l_t - log sum_i e^l_i then moves by at most two steps of its token's logit plus
    # sum_i p_i 2 step(l_i) for the normaliser (seen: 5e-4 on a Xeon with AMX; 1.9e-3, one step of a logit in
    # [0.25, 0.5), on an AVX2 EPYC); the all-bf16 trial that put the norms and the LM head in bf16 was 0.5 nats away.
    _, exponent = torch.frexp(scored)
    steps = torch.ldexp(torch.ones_like(scored), exponent - 8)  # bf16 keeps 8 significant bits
    chosen = ids[0, len(prompt) :, None]
    bound = 2 * (steps.gather(-1, chosen)[:, 0] + (torch.softmax(scored, -1) * steps).sum(-1))
    gap = (torch.tensor(sample.logprobs) - expected).abs()
    assert bool((gap <= bound).all()), f"log-prob gaps {gap.tolist()} over bf16 bounds {bound.tolist()}"


DTYPES = ("float32", "bfloat16")


def test_the_lm_head_is_timed_once_per_row_count_and_either_layout_gives_its_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decoder_module, "_HEAD_PACKED_BY_SHAPE", {})
    generator = torch.Generator().manual_seed(0)
    head = torch.randn(1000, 64, generator=generator)
    packed = decoder_module._pack_float32(head)
    assert packed is not None and len(packed) == 1 and packed[0].is_mkldnn
    states = torch.randn(4, 64, generator=generator)
    expected = torch.nn.functional.linear(states, head)
    timed = decoder_module.head_logits(states, head, packed)
    decided = decoder_module._HEAD_PACKED_BY_SHAPE
    assert list(decided) == [(1000, 64, 4, torch.float32)]
    torch.testing.assert_close(timed, expected, atol=1e-5, rtol=1e-5)
    for use_packed in (False, True):  # the layout a row count was given is the one it runs
        decided[(1000, 64, 4, torch.float32)] = use_packed
        logits = decoder_module.head_logits(states, head, packed)
        assert logits.shape == (4, 1000)
        if use_packed:
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
            assert torch.equal(logits, torch.ops.mkldnn._linear_pointwise(states, packed[0], None, "none", [], ""))
        else:
            assert torch.equal(logits, expected)
    decoder_module.head_logits(states[:2], head, packed)  # another row count is timed on its own
    assert sorted(rows for _, _, rows, _ in decided) == [2, 4]
    assert decoder_module.head_logits(states, head) is not None and len(decided) == 2  # no packed copy: not timed


def test_a_float32_cpu_decoder_keeps_a_packed_copy_of_its_head_only() -> None:
    model = tiny_llama()
    lean = LeanDecoder(model)
    assert lean.lm_head_packed is not None and [part.is_mkldnn for part in lean.lm_head_packed] == [True]
    assert not lean.lm_head.is_mkldnn and lean.lm_head.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not any(layer.qkv.is_mkldnn or layer.gate_up.is_mkldnn for layer in lean.layers)
    assert decoder_module._pack_float32(torch.zeros(8, 4, dtype=torch.bfloat16)) is None


def test_a_forward_helper_shares_the_heads_product_and_gives_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoder_module, "_HEAD_PACKED_BY_SHAPE", {})
    generator = torch.Generator().manual_seed(0)
    head = torch.randn(1000, 64, generator=generator)
    slices = decoder_module._pack_float32(head, decoder_module.HEAD_CHUNKS)
    assert slices is not None and len(slices) == decoder_module.HEAD_CHUNKS
    helper = decoder_module.ForwardHelper()
    try:
        for rows in (1, 3, 8, 32):
            states = torch.randn(rows, 64, generator=generator)
            one_thread = decoder_module._packed_product(states, slices)
            shared = helper.product(states, slices)
            assert torch.equal(shared, one_thread) and shared.shape == (rows, 1000)
            torch.testing.assert_close(shared, torch.nn.functional.linear(states, head), atol=1e-5, rtol=1e-5)
            before = helper._generation
            assert torch.equal(decoder_module.head_logits(states, head, slices, helper), one_thread)
            assert helper._generation == before + 1  # the head's product went to the helper's slices
        assert decoder_module._HEAD_PACKED_BY_SHAPE == {}  # with a helper, its slices untimed
        with pytest.raises(RuntimeError):  # a failed product reaches the caller; the helper serves the next one
            helper.product(torch.randn(2, 65, generator=generator), slices)
        states = torch.randn(2, 64, generator=generator)
        assert torch.equal(helper.product(states, slices), decoder_module._packed_product(states, slices))
    finally:
        helper.close()
    assert not helper._thread.is_alive()


def counted_parts(helper: decoder_module.ForwardHelper, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of parts of each operation `helper` shares from now on (appended as they are run)."""
    parts: list[int] = []
    run = helper.run

    def counted(jobs: list[Any]) -> list[Any]:
        parts.append(len(jobs))
        return run(jobs)

    monkeypatch.setattr(helper, "run", counted)
    return parts


@pytest.mark.skipif(not decoder_module._onednn_bf16(), reason="oneDNN has no native bf16 matmul on this CPU")
def test_packed_products_are_shared_by_chunks_of_rows_from_their_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed projection and a packed MLP are split between two threads by chunks of their input's rows, each
    the one product's values for its rows (and the formula's, computed in float64 from the same bf16 numbers), from
    `SHARED_PACKED_MACS` only; a large prefill is cut into more chunks than threads."""
    generator = torch.Generator().manual_seed(5)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).bfloat16()

    weight, bias, states = bf16(96, 40), bf16(96), bf16(3, 5, 40)  # states: [batch, new, hidden], a prefill's
    gate, up, down = bf16(24, 40), bf16(24, 40), bf16(40, 24)
    exact_linear = F.linear(states.double(), weight.double(), bias.double())
    gated = F.silu(F.linear(states.double(), gate.double())) * F.linear(states.double(), up.double())
    exact_mlp = F.linear(gated, down.double())
    packed, gate_up, packed_down = (decoder_module._pack(m) for m in (weight, torch.cat((gate, up)), down))
    assert packed.is_mkldnn and gate_up.is_mkldnn and packed_down.is_mkldnn
    whole_linear = decoder_module._linear(states, packed, bias)
    whole_mlp = decoder_module._fused_mlp(states, gate_up, packed_down)
    helper = decoder_module.ForwardHelper()

    def products() -> None:
        linear = decoder_module.shared_linear(states, packed, bias, helper)
        mlp = decoder_module.shared_mlp(states, gate_up, packed_down, helper)
        assert linear.shape == whole_linear.shape and mlp.shape == whole_mlp.shape
        torch.testing.assert_close(linear, whole_linear)
        torch.testing.assert_close(mlp, whole_mlp)
        # Within a few bf16 roundings of the formula (gate/up and the gated units are rounded to bf16 too).
        for shared, exact in ((linear, exact_linear), (mlp, exact_mlp)):
            torch.testing.assert_close(shared.double(), exact, atol=0.02 * exact.abs().max().item(), rtol=0.02)

    try:
        products()
        assert helper._generation == 0, "below the threshold: one product on the caller's thread"
        monkeypatch.setattr(
            decoder_module, "SHARED_PACKED_MACS", 15 * 3 * 40 * 24
        )  # the MLP's (the projection: 57,600)
        products()
        assert helper._generation == 2, "from the threshold: one hand-off each"
        parts = counted_parts(helper, monkeypatch)
        monkeypatch.setattr(decoder_module, "PACKED_ROWS_PER_PART", 4)
        products()  # 15 rows by chunks of >= 4 rows: 3 chunks of 5
        assert parts == [3, 3]
    finally:
        helper.close()


def test_shared_projections_and_attention_equal_one_threads_and_small_ones_are_not_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(96, 40, generator=generator), torch.randn(96, generator=generator)
    states = torch.randn(3, 5, 40, generator=generator)  # [batch, new, hidden], as in a prefill
    helper = decoder_module.ForwardHelper()
    try:
        expected = torch.nn.functional.linear(states, weight, bias)
        assert torch.equal(decoder_module.shared_linear(states, weight, bias, helper), expected)
        assert helper._generation == 0, "600 multiply-adds a row: below the thresholds, not shared"
        monkeypatch.setattr(decoder_module, "SHARED_PRODUCT_MACS", 0)
        shared = decoder_module.shared_linear(states, weight, bias, helper)
        assert helper._generation == 1 and shared.shape == expected.shape
        torch.testing.assert_close(shared, expected, atol=1e-6, rtol=1e-6)
        monkeypatch.setattr(decoder_module, "SHARED_PRODUCT_MACS", 1 << 40)
        monkeypatch.setattr(decoder_module, "SHARED_PRODUCT_WEIGHTS", weight.numel())  # a large matrix: shared
        torch.testing.assert_close(
            decoder_module.shared_linear(states[:1, :1], weight, None, helper), expected[:1, :1] - bias
        )
        assert helper._generation == 2

        heads, kv_heads, head_dim, columns = 4, 2, 8, 7
        for batch, new in ((3, 1), (1, 4)):  # decode rows split by batch; one row's prefill by key/value heads
            q = torch.randn(batch, heads, new, head_dim, generator=generator)
            keys = torch.randn(batch, kv_heads, columns, head_dim, generator=generator)
            values = torch.randn(batch, kv_heads, columns, head_dim, generator=generator)
            allowed = torch.rand(batch, 1, new, columns, generator=generator) > 0.4
            allowed[..., -1] = True
            expected = torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=allowed, scale=0.3, enable_gqa=True
            )
            before = helper._generation
            assert torch.equal(decoder_module.shared_attention(q, keys, values, allowed, 0.3, helper), expected)
            assert helper._generation == before, "below SHARED_ATTENTION_MACS: not shared"
            monkeypatch.setattr(decoder_module, "SHARED_ATTENTION_MACS", 0)
            shared = decoder_module.shared_attention(q, keys, values, allowed, 0.3, helper)
            monkeypatch.setattr(decoder_module, "SHARED_ATTENTION_MACS", 1 << 40)
            assert helper._generation == before + 1 and shared.shape == expected.shape
            torch.testing.assert_close(shared, expected, atol=1e-6, rtol=1e-6)
    finally:
        helper.close()


def test_a_prefills_attention_is_shared_in_chunks_of_the_batch_by_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """One chunk of the batch per `ATTENTION_PART_MACS` (at least two, at most `ATTENTION_PARTS`, at most one a
    row), each row attended by the kernel that attends the whole batch."""
    assert decoder_module._chunks(5, 3) == [slice(0, 1), slice(1, 3), slice(3, 5)]
    assert decoder_module._chunks(4, 2) == [slice(0, 2), slice(2, 4)]
    generator = torch.Generator().manual_seed(6)
    batch, heads, kv_heads, new, columns, head_dim = 5, 4, 2, 3, 9, 8
    q = torch.randn(batch, heads, new, head_dim, generator=generator)
    keys, values = (torch.randn(batch, kv_heads, columns, head_dim, generator=generator) for _ in "kv")
    allowed = torch.rand(batch, 1, new, columns, generator=generator) > 0.3
    allowed[..., -1] = True
    expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=0.3, enable_gqa=True)
    macs = batch * heads * new * columns * head_dim
    monkeypatch.setattr(decoder_module, "SHARED_ATTENTION_MACS", 0)
    helper = decoder_module.ForwardHelper()
    parts = counted_parts(helper, monkeypatch)
    try:
        for part_macs, cap in ((macs, 8), (macs // 3, 8), (1, 8), (1, 4)):
            monkeypatch.setattr(decoder_module, "ATTENTION_PART_MACS", part_macs)
            monkeypatch.setattr(decoder_module, "ATTENTION_PARTS", cap)
            shared = decoder_module.shared_attention(q, keys, values, allowed, 0.3, helper)
            torch.testing.assert_close(shared, expected, atol=1e-6, rtol=1e-6)
    finally:
        helper.close()
    assert parts == [2, 3, 5, 4]  # two at least; one per part's multiply-adds; one a row at most; the cap


@pytest.mark.parametrize("units", [6, 7], ids=["even", "odd"])
def test_a_shared_mlp_is_the_sum_of_its_halves_and_a_small_one_is_not_shared(
    monkeypatch: pytest.MonkeyPatch, units: int
) -> None:
    generator = torch.Generator().manual_seed(4)
    hidden = 5
    gate, up = torch.randn(units, hidden, generator=generator), torch.randn(units, hidden, generator=generator)
    down = torch.randn(hidden, units, generator=generator)
    states = torch.randn(2, 3, hidden, generator=generator)  # [batch, new, hidden]
    gate_up = torch.cat([gate, up])
    # By hand: silu(a) = a / (1 + e^-a), unit by unit, then each output the sum over the units.
    a, b = states @ gate.T, states @ up.T
    expected = (a / (1 + torch.exp(-a)) * b) @ down.T
    helper = decoder_module.ForwardHelper()
    try:
        alone = decoder_module.shared_mlp(states, gate_up, down, helper)
        assert helper._generation == 0, "6 rows x 3 x 5 x units multiply-adds: below SHARED_MLP_MACS, not shared"
        assert torch.equal(alone, decoder_module.shared_mlp(states, gate_up, down, None))
        torch.testing.assert_close(alone, expected, atol=1e-5, rtol=1e-5)
        monkeypatch.setattr(decoder_module, "SHARED_MLP_MACS", 0)
        shared = decoder_module.shared_mlp(states, gate_up, down, helper)
        assert helper._generation == 1 and shared.shape == expected.shape
        torch.testing.assert_close(shared, expected, atol=1e-5, rtol=1e-5)
        first = slice(0, units // 2)  # the caller's half, then the helper's (or the other way round)
        half = decoder_module._mlp_half(states, gate[first], up[first], down[:, first])
        rest = decoder_module._mlp_half(states, gate[units // 2 :], up[units // 2 :], down[:, units // 2 :])
        assert torch.equal(shared, half + rest)
    finally:
        helper.close()


def test_an_engine_with_one_thread_and_a_spare_core_shares_its_head_and_generates_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from agentgym.inference import engine as engine_module

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setattr(engine_module, "available_cpus", lambda: 2)
        assert engine_module.wants_forward_helper(torch.device("cpu"))
        assert not engine_module.wants_forward_helper(torch.device("cuda"))
        torch.set_num_threads(2)  # the head is a parallel product already
        assert not engine_module.wants_forward_helper(torch.device("cpu"))
        torch.set_num_threads(1)
        monkeypatch.setattr(engine_module, "available_cpus", lambda: 1)
        assert not engine_module.wants_forward_helper(torch.device("cpu"))
        results = {}
        for shared in (True, False):
            monkeypatch.setattr(engine_module, "wants_forward_helper", lambda device, shared=shared: shared)
            engine = Engine(tiny_model_dir(), device="cpu", max_batch_size=4)
            try:
                assert engine._lean is not None and engine._lean.lm_head_packed is not None
                assert (engine._forward_helper is not None) == shared
                assert len(engine._lean.lm_head_packed) == (decoder_module.HEAD_CHUNKS if shared else 1)
                results[shared] = asyncio.run(_greedy(engine))
            finally:
                engine.close()
            assert engine._forward_helper is None or not engine._forward_helper._thread.is_alive()
        assert results[True] == results[False]
        monkeypatch.setattr(engine_module, "wants_forward_helper", lambda device: True)
        monkeypatch.setenv("AGENTGYM_LEAN_DECODER", "0")  # transformers' forward: no head to share, no thread
        engine = Engine(tiny_model_dir(), device="cpu", max_batch_size=4)
        try:
            assert engine._lean is None and engine._forward_helper is None
        finally:
            engine.close()
    finally:
        torch.set_num_threads(threads)


def test_bf16_attention_is_timed_once_per_shape_and_either_way_is_the_float32_formula(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In float32 or in bf16, attention over bf16-rounded inputs is softmax(q K^T / sqrt(d) + mask) V with float32
    scores: computed here by hand, one query head at a time with its key/value head. In float32 the result is that
    value rounded once to bf16; torch's bf16 kernel also rounds the probabilities to bf16 before weighting the values
    (2^-9 of each p_i |v_i|). A decoder attends (prefill and decode) and caches in float32 where a decode step was
    timed faster so, else in bf16."""
    monkeypatch.setattr(decoder_module, "_ATTENTION_FLOAT32_BY_SHAPE", {})
    generator = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, head_dim, columns = 3, 4, 2, 8, 6
    q = torch.randn(batch, heads, 1, head_dim, generator=generator).bfloat16()
    keys = torch.randn(batch, kv_heads, columns, head_dim, generator=generator).bfloat16()
    values = torch.randn(batch, kv_heads, columns, head_dim, generator=generator).bfloat16()
    allowed = torch.rand(batch, 1, 1, columns, generator=generator) > 0.4
    allowed[..., -1] = True
    scale = head_dim**-0.5
    expected, spread = torch.empty(batch, heads, 1, head_dim), torch.empty(batch, heads, 1, head_dim)
    for row in range(batch):
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = [
                float(q[row, head, 0].float() @ keys[row, kv, column].float()) * scale
                if allowed[row, 0, 0, column]
                else float("-inf")
                for column in range(columns)
            ]
            top = max(scores)
            weights = torch.tensor([math.exp(score - top) for score in scores])
            probabilities = weights / weights.sum()
            expected[row, head, 0] = probabilities @ values[row, kv].float()
            spread[row, head, 0] = probabilities @ values[row, kv].float().abs()
    attend = decoder_module.shared_attention
    in_float32 = attend(q.float(), keys.float(), values.float(), allowed, scale, None).bfloat16()
    bf16 = attend(q, keys, values, allowed, scale, None)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(in_float32, expected.bfloat16()) or bool(
        ((in_float32.float() - expected).abs() <= 2**-8 * expected.abs()).all()  # the f32 sums' order, one rounding
    )
    gap = (bf16.float() - expected).abs()
    assert bool((gap <= 2**-8 * (expected.abs() + spread)).all()), (gap / (expected.abs() + spread)).max().item()
    # The choice is timed on the first decoder of a shape and kept for the process.
    model = tiny_qwen2()
    lean = LeanDecoder.for_model(model, torch.bfloat16)
    assert lean is not None
    shape = (lean.heads, lean.kv_heads, lean.head_dim, torch.bfloat16)
    assert dict(decoder_module._ATTENTION_FLOAT32_BY_SHAPE) == {shape: lean.attention_in_float32}
    calls: list[torch.dtype] = []  # the queries' dtype of each attention

    def record(*args: Any) -> torch.Tensor:
        calls.append(args[0].dtype)
        return attend(*args)

    monkeypatch.setattr(decoder_module, "shared_attention", record)
    for choice in (True, False):
        decoder_module._ATTENTION_FLOAT32_BY_SHAPE[shape] = choice
        again = LeanDecoder.for_model(tiny_qwen2(), torch.bfloat16)
        assert again is not None and again.attention_in_float32 is choice
        assert calls == [], "timed again"
        dtype = torch.float32 if choice else torch.bfloat16
        assert again.kv_dtype == dtype
        ids, mask, positions = left_padded([5, 3], int(model.config.vocab_size), torch.Generator().manual_seed(6))
        cache = growing_cache(model)
        with torch.inference_mode():
            again.forward(ids, mask, positions, cache)  # a prefill
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            again.forward(torch.tensor([[7], [9]]), step_mask, positions[:, -1:] + 1, cache)  # a decode step
        assert calls == [dtype] * 2 * len(again.layers)
        calls.clear()
        # The cache holds bf16-rounded keys and values in either dtype.
        for layer in cache.layers:
            assert layer.keys.dtype == layer.values.dtype == dtype
            assert torch.equal(layer.keys, layer.keys.bfloat16().to(dtype))
            assert torch.equal(layer.values, layer.values.bfloat16().to(dtype))
    float32_engine = LeanDecoder.for_model(tiny_qwen2())
    assert float32_engine is not None and not float32_engine.attention_in_float32  # no rule without bf16 matmuls
    assert float32_engine.kv_dtype == torch.float32


@pytest.mark.skipif(not decoder_module._onednn_bf16(), reason="oneDNN has no native bf16 matmul on this CPU")
def test_a_packed_bf16_head_is_sliced_for_a_helper_and_either_layout_gives_its_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a helper, a packed bf16 head also keeps `HEAD_CHUNKS` packed vocabulary slices, which the head's product
    is shared by (untimed); without one, the whole packed matrix. Both give the head's logits."""
    monkeypatch.setattr(decoder_module, "_HEAD_PACKED_BY_SHAPE", {})
    helper = decoder_module.ForwardHelper()
    try:
        model = tiny_qwen2()
        head = model.lm_head.weight.detach().bfloat16().float()  # the bf16 values, to multiply in float32 by hand
        alone = LeanDecoder.for_model(tiny_qwen2(), torch.bfloat16)
        shared = LeanDecoder.for_model(model, torch.bfloat16, helper)
        assert alone is not None and shared is not None and alone.lm_head_packed is None
        assert shared.lm_head.is_mkldnn and shared.lm_head_packed is not None
        assert [part.is_mkldnn for part in shared.lm_head_packed] == [True] * decoder_module.HEAD_CHUNKS
        states = torch.randn(3, head.shape[1], generator=torch.Generator().manual_seed(7)).bfloat16()
        expected = states.float() @ head.T  # float32 sums of the bf16 products; each kernel rounds once to bf16
        before = helper._generation
        sliced = decoder_module.head_logits(states, shared.lm_head, shared.lm_head_packed, helper)
        assert helper._generation == before + 1
        assert torch.equal(sliced, decoder_module._packed_product(states, shared.lm_head_packed))
        whole = decoder_module.head_logits(states, alone.lm_head, alone.lm_head_packed)
        for logits in (sliced, whole):
            assert logits.shape == expected.shape
            torch.testing.assert_close(logits.float(), expected, atol=1e-2, rtol=2**-7)
        assert decoder_module._HEAD_PACKED_BY_SHAPE == {}  # nothing timed
    finally:
        helper.close()


def test_a_sliced_head_gives_the_heads_logits_and_their_sampling_weights() -> None:
    """The head multiplied by its packed vocabulary slices on two threads, each writing its logits and their
    sampling weights (`sampling.SliceWeights`): the logits of `head_logits` exactly, weights exp(l - slice peak),
    block sums of them; only for equal slices of whole `CDF_BLOCK`s."""
    from agentgym.inference.sampling import CDF_BLOCK

    helper = decoder_module.ForwardHelper()
    try:
        model = tiny_llama()
        lean = LeanDecoder.for_model(model, helper=helper)
        assert lean is not None and lean.lm_head_packed is not None
        states = torch.randn(6, int(model.config.hidden_size), generator=torch.Generator().manual_seed(8))
        assert decoder_module.head_in_slices(states, lean.lm_head_packed)
        assert not decoder_module.head_in_slices(states[None], lean.lm_head_packed)  # not one row a sequence
        assert not decoder_module.head_in_slices(states, lean.lm_head_packed[:1])  # one slice: nothing shared
        odd = decoder_module._pack_float32(torch.randn(CDF_BLOCK + 8, int(model.config.hidden_size)))
        assert odd is not None  # slices of unequal widths, or not whole blocks: weights made by the sampler
        assert not decoder_module.head_in_slices(states, [*lean.lm_head_packed[:-1], *odd])
        assert not decoder_module.head_in_slices(states, [*odd, *odd])
        before = helper._generation
        logits, slices = decoder_module.sliced_head(states, lean.lm_head_packed, helper)
        assert helper._generation == before + 1
        expected = decoder_module.head_logits(states, lean.lm_head, lean.lm_head_packed, helper).float()
        assert torch.equal(logits, expected)
        width = slices.slice_width
        assert width * decoder_module.HEAD_CHUNKS == logits.shape[1] and width % CDF_BLOCK == 0
        peaks = logits.unflatten(1, (decoder_module.HEAD_CHUNKS, width)).amax(dim=-1)
        assert torch.equal(slices.peaks, peaks)
        torch.testing.assert_close(slices.weights, (logits - peaks.repeat_interleave(width, dim=1)).exp())
        torch.testing.assert_close(slices.block_sums, slices.weights.unflatten(1, (-1, CDF_BLOCK)).sum(dim=-1))
    finally:
        helper.close()


def test_the_engine_samples_the_same_tokens_with_the_weights_of_a_sliced_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded requests at temperature 1 decoded with the sampling weights made by the sliced head and with those
    made by `choose_tokens` over the whole logits: the same tokens, logprobs within float32 rounding; a batch
    with a greedy row takes no weights."""
    import asyncio

    from agentgym.inference import engine as engine_module

    monkeypatch.setattr(engine_module, "wants_forward_helper", lambda device: True)
    made: list[bool] = []
    sliced_head = decoder_module.sliced_head

    def counted(*args: Any) -> Any:
        made.append(True)
        return sliced_head(*args)

    monkeypatch.setattr(decoder_module, "sliced_head", counted)
    prompts = [[1, *range(100 + 7 * row, 120 + 11 * row)] for row in range(4)]

    async def generate(engine: Engine, temperature: float) -> list[Any]:
        params = [SamplingParams(max_tokens=12, temperature=temperature, seed=row, ignore_eos=True) for row in range(4)]
        outputs = await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params, strict=True)))
        return [output.samples[0] for output in outputs]

    results = {}
    for sliced in (True, False):
        monkeypatch.setattr(decoder_module, "head_in_slices", lambda *args, sliced=sliced: sliced)
        engine = Engine(tiny_model_dir(), device="cpu", max_batch_size=4)
        try:
            made.clear()
            results[sliced] = asyncio.run(generate(engine, 1.0))
            assert bool(made) == sliced
            made.clear()
            asyncio.run(generate(engine, 0.0))  # greedy rows: no weights asked for
            assert not made
        finally:
            engine.close()
    for with_slices, without in zip(results[True], results[False], strict=True):
        assert with_slices.token_ids == without.token_ids
        assert with_slices.logprobs == pytest.approx(without.logprobs, abs=1e-5)

"""Which models run packed rows, checked on a tiny random model of each model type the server
packs: the packed encoder (attention registered through transformers' AttentionInterface,
position ids per row with the model's own offset) computes what the padded one does. And the
models it does not pack: ATTENTION=auto falls back to padded rows, ATTENTION=packed refuses."""

import numpy as np
import pytest
import torch

from embedserve.model import varlen
from embedserve.config import ConfigError, Settings
from embedserve.model.declared import POOLING_MODES, Head
from embedserve.model.encoder import Encoder, Placement, choose_placement
from embedserve.model.batches import PackSpec, random_packed
from embedserve.model.batches import Batch

HEAD = Head(POOLING_MODES, False, (), 64, False, {}, None)


def tiny(tmp_path, model_type: str, **extra) -> str:
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    if model_type in varlen.CAUSAL:  # grouped-query attention, as these decoders have
        extra = {"num_key_value_heads": 2, **extra}
    config = AutoConfig.for_model(model_type, vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=80, pad_token_id=1, **extra)
    path = tmp_path / model_type
    AutoModel.from_config(config).save_pretrained(path)
    return str(path)


def encoder(path: str, attention: str, task: str = "embed", placement: Placement | None = None) -> Encoder:
    settings = Settings.from_env({"ATTENTION": attention})
    return Encoder(path, settings, placement or choose_placement(settings, False, False), [], task, HEAD)


@pytest.mark.parametrize("model_type", sorted(varlen.POSITION_OFFSET))
def test_every_packed_model_type_computes_what_its_padded_model_does(tmp_path, model_type):
    path = tiny(tmp_path, model_type)
    packed, padded = encoder(path, "packed"), encoder(path, "padded")
    assert packed.attention == "packed" and packed.model.config._attn_implementation == varlen.NAME
    spec = PackSpec(max_len=64, max_rows=8, ladder=(128, 160))
    batch = random_packed(150, spec, 500, np.random.default_rng(0), shortest=2)
    cu = batch.cu_seqlens.tolist()
    lengths = [cu[i + 1] - cu[i] for i in range(batch.rows)]
    ids = torch.full((batch.rows, max(lengths)), 1, dtype=torch.int64)  # the pad id
    for i, n in enumerate(lengths):
        ids[i, :n] = batch.input_ids[cu[i] : cu[i] + n]
    mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
    want = padded.run(Batch(ids, mask, batch.rows, batch.real_tokens, []))
    np.testing.assert_allclose(packed.run(batch), want, atol=1e-5)


def test_the_position_offset_follows_the_model():
    from transformers import AutoConfig

    assert varlen.position_offset(AutoConfig.for_model("bert")) == 0
    assert varlen.position_offset(AutoConfig.for_model("xlm-roberta", pad_token_id=1)) == 2


@pytest.mark.parametrize(
    "model_type, extra, task, device, dtype, capability, reason",
    [
        ("bert", {}, "embed", "cuda", torch.bfloat16, (9, 0), None),
        ("bert", {}, "embed", "cuda", torch.float32, (7, 5), None),  # fp32: the memory-efficient kernel
        ("bert", {}, "classify", "cpu", torch.float32, None, "classifier"),
        ("bert", {}, "sparse", "cuda", torch.bfloat16, (9, 0), "SPLADE's masked-LM head reads padded rows"),
        ("qwen3", {}, "embed", "cuda", torch.bfloat16, (9, 0), None),  # decoders: causal varlen attention
        ("mistral", {}, "embed", "cuda", torch.bfloat16, (9, 0), None),
        ("qwen2", {}, "embed", "cuda", torch.bfloat16, (9, 0), None),
        ("llama", {}, "embed", "cuda", torch.bfloat16, (9, 0), "model type 'llama' is a decoder this server does not pack"),
        ("mistral", {"sliding_window": 256}, "embed", "cuda", torch.bfloat16, (9, 0), "sliding attention window (256"),
        ("distilbert", {}, "embed", "cpu", torch.float32, None, "model type 'distilbert'"),
        ("bert", {"is_decoder": True}, "embed", "cpu", torch.float32, None, "decoder"),
        ("bert", {}, "embed", "cuda", torch.float16, (7, 5), "compute capability 8.0"),
        ("bert", {"hidden_size": 36, "num_attention_heads": 3}, "embed", "cuda", torch.bfloat16, (9, 0), "multiple of 8"),
    ],
)
def test_which_models_and_devices_run_packed_rows(model_type, extra, task, device, dtype, capability, reason):
    from transformers import AutoConfig

    why = varlen.unsupported(AutoConfig.for_model(model_type, **extra), task, device, dtype, capability)
    assert (why is None) if reason is None else (reason in why)


def test_auto_falls_back_to_padded_rows_and_packed_refuses(tmp_path):
    """ATTENTION=auto asks for packed rows where the kernels run (CUDA, half precision); for a
    model they cannot serve it keeps padded rows, while an explicit ATTENTION=packed is a
    start-up error that says why."""
    path = tiny(tmp_path, "distilbert")
    asked = Placement(torch.device("cpu"), torch.float32, False, False, False, "packed")
    assert encoder(path, "auto", placement=asked).attention == "padded"
    with pytest.raises(ConfigError, match="ATTENTION=packed: model type 'distilbert'"):
        encoder(path, "packed", placement=asked)
    with pytest.raises(ConfigError, match="classifier"):
        encoder(tiny(tmp_path, "bert"), "packed", task="classify")


def test_the_attention_implementation_runs_packed_rows_only():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="packed rows only"):
        varlen.varlen_attention(None, q, q, q, None)


def test_the_reference_attention_never_crosses_rows():
    """Changing one row's keys changes no other row's output."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    out = varlen.reference_attention(q, k, v, cu, None)
    k2 = k.clone()
    k2[3:] += 1.0
    out2 = varlen.reference_attention(q, k2, v, cu, None)
    torch.testing.assert_close(out[:3], out2[:3])
    assert not torch.allclose(out[3:], out2[3:])
    ref = torch.nn.functional.scaled_dot_product_attention(*(x[:3].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
    torch.testing.assert_close(out[:3], ref)


def test_the_start_up_self_check_passes_the_reference_and_catches_a_kernel_that_crosses_rows():
    """What a CUDA server runs before it trusts the varlen kernel, here with CPU stand-ins: the
    reference itself agrees; a kernel that attends across rows (one SDPA over the whole stream)
    and a kernel that raises are both named, so ATTENTION=auto falls back to padded rows."""
    cpu = torch.device("cpu")

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return varlen.reference_attention(q, k, v, cu_q, scale)

    def across_rows(q, k, v, *_):
        return torch.nn.functional.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v))).transpose(0, 1)

    def broken(*_):
        raise RuntimeError("no kernel image is available for execution on the device")

    assert varlen.self_check(cpu, torch.float32, 4, 16, False, kernel=reference) is None
    assert "differs from the reference attention" in varlen.self_check(cpu, torch.float32, 4, 16, False, kernel=across_rows)
    assert "fails here (RuntimeError: no kernel image" in varlen.self_check(cpu, torch.float32, 4, 16, False, kernel=broken)


def test_the_causal_self_check_passes_a_causal_kernel_and_catches_one_that_looks_ahead():
    """A decoder's check: the kernel must attend, within each row, to the tokens up to each one."""
    cpu = torch.device("cpu")

    def causal(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=False):
        return varlen.reference_attention(q, k, v, cu_q, scale, causal)

    def bidirectional(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=False):
        return varlen.reference_attention(q, k, v, cu_q, scale)

    assert varlen.self_check(cpu, torch.float32, 4, 16, False, kernel=causal, causal=True) is None
    assert "differs from the reference" in varlen.self_check(cpu, torch.float32, 4, 16, False, kernel=bidirectional,
                                                            causal=True)


def test_a_kernel_that_returns_nan_fails_the_self_check():
    def nan(q, *_):
        return torch.full_like(q, float("nan"))

    assert "differs from the reference attention" in varlen.self_check(torch.device("cpu"), torch.float32, 4, 16, False,
                                                                        kernel=nan)


REMOTE_CODE = """
from transformers import BertModel


class DropsRowBounds(BertModel):
    \"\"\"Remote code as it may be: a forward that does not pass transformers' packed-sequence
    keywords on, so its attention never sees the rows' bounds.\"\"\"

    def forward(self, *args, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **kwargs):
        return super().forward(*args, **kwargs)
"""


def remote_code_model(tmp_path) -> str:
    import json

    path = tiny(tmp_path, "bert")
    (tmp_path / "bert" / "modeling_drops.py").write_text(REMOTE_CODE)
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_drops.DropsRowBounds"}
    (tmp_path / "bert" / "config.json").write_text(json.dumps(config))
    return path


def test_a_model_that_ignores_the_row_bounds_is_served_padded_under_auto_and_refused_under_packed(tmp_path):
    """The check of the loaded model (packed rows against the same rows padded) at start-up:
    with a model whose code drops the row bounds, ATTENTION=auto reloads it and serves padded
    rows, whose vectors are the plain model's; ATTENTION=packed refuses to start, saying why."""
    path = remote_code_model(tmp_path)
    asked = Placement(torch.device("cpu"), torch.float32, False, False, False, "packed")

    def build(attention):
        settings = Settings.from_env({"ATTENTION": attention, "TRUST_REMOTE_CODE": "true"})
        return Encoder(path, settings, asked, [], "embed", HEAD)

    served = build("auto")
    assert served.attention == "padded" and type(served.model).__name__ == "DropsRowBounds"
    plain = encoder(path, "padded")
    ids = torch.randint(5, 500, (2, 9))
    batch = Batch(ids, torch.ones_like(ids), 2, 18, [])
    np.testing.assert_allclose(served.run(batch), plain.run(batch), atol=1e-6)
    with pytest.raises(ConfigError, match="ATTENTION=packed: packed rows fail on this model"):
        build("packed")


def test_the_model_check_catches_attention_across_rows(tmp_path):
    """transformers' own SDPA reads no row bounds: on a packed stream it attends across rows."""
    path = tiny(tmp_path, "bert")
    good = encoder(path, "packed")
    assert good.attention == "packed" and good._check_packed() is None
    good.model.set_attn_implementation("sdpa")  # the loaded model now ignores the row bounds
    assert "packed rows differ from padded rows" in good._check_packed()


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu.sh runs these)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("model_type", ["qwen3", "mistral"])
def test_a_decoder_runs_packed_rows_with_causal_attention(tmp_path, device, model_type):
    """ATTENTION=auto on a GPU packs a decoder's rows (causal varlen attention, after the causal
    self-check), in bf16 replayed from CUDA graphs at the ladder's sizes; on CPU the reference
    attention. With last-token pooling each real row's vector is what the float32 eager model
    computes on that row alone, padded: attention stays within the row and looks only back."""
    path = tiny(tmp_path, model_type)
    settings = Settings.from_env({"ATTENTION": "auto"})
    placement = (choose_placement(settings, True, True) if device == "cuda" else
                 Placement(torch.device("cpu"), torch.float32, False, False, False, "packed"))
    head = Head(("lasttoken",), True, (), 64, False, {}, None)
    served = Encoder(path, settings, placement, [], "embed", head)
    assert served.attention == "packed" and served.declined is None
    reference = Encoder(path, Settings.from_env({"ATTENTION": "padded"}),
                        Placement(torch.device("cpu"), torch.float32, False, False), [], "embed", head)
    spec = PackSpec(max_len=64, max_rows=8, ladder=(128, 160) if placement.cuda_graphs else None)
    rng = np.random.default_rng(0)
    for tokens in (150, 120):  # on CUDA: one capture, then a replay on other rows
        batch = random_packed(tokens, spec, 500, rng, shortest=1)
        got = served.run(batch)[: batch.rows]
        cu = batch.cu_seqlens.tolist()
        for i in range(batch.rows):
            ids = batch.input_ids[cu[i] : cu[i + 1]].unsqueeze(0)
            alone = reference.run(Batch(ids, torch.ones_like(ids), 1, ids.shape[1], []))[0]
            tolerance = 3e-2 if placement.dtype in varlen.HALF else 1e-5  # unit vectors: bf16's rounding
            assert np.abs(got[i] - alone).max() <= tolerance, (i, np.abs(got[i] - alone).max())

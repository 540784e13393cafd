"""Reading a model directory's sentence-transformers declaration, and the environment's overrides."""

import json

import pytest

from embedserve.model.declared import Declared, DeclarationError, read, resolve


def write(root, files: dict) -> str:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return str(root)


MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]


def test_the_packaged_model_declares_mean_normalize_and_256_tokens(model_dir):
    d = read(model_dir)
    assert (d.pooling, d.normalize, d.max_seq_length, d.dense, d.prompts) == (("mean",), True, 256, (), {})


def test_the_older_flag_format_and_several_modes(tmp_path):
    d = read(write(tmp_path, {"modules.json": MODULES, "1_Pooling/config.json": {
        "word_embedding_dimension": 8, "pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}}))
    assert d.pooling == ("cls", "max") and not d.normalize


def test_prompts_and_their_default(tmp_path):
    d = read(write(tmp_path, {"modules.json": MODULES, "1_Pooling/config.json": {"pooling_mode": "cls"},
                              "config_sentence_transformers.json": {"prompts": {"query": "q: ", "doc": ""},
                                                                    "default_prompt_name": "query"}}))
    head, _ = resolve(d, "", None, 512, 512, 512)
    assert head.prompt(None) == "q: " and head.prompt("doc") == ""
    with pytest.raises(KeyError, match="unknown prompt_name 'x'; this model's prompts: doc, query"):
        head.prompt("x")


def test_a_declared_truncate_dim_is_the_served_default(tmp_path):
    """sentence-transformers takes truncate_dim in its constructor and saves nothing of it; a
    model's authors state it in config_sentence_transformers.json, and we serve it by default."""
    d = read(write(tmp_path, {"modules.json": MODULES, "config_sentence_transformers.json": {"truncate_dim": 64}}))
    head, _ = resolve(d, "", None, 512, 512, 512)
    assert head.truncate_dim == 64 and head.dimension(384) == 64 and head.describe()["truncate_dim"] == 64
    head.check_dimension(64)
    with pytest.raises(DeclarationError, match="truncate_dim 64 exceeds the model's 32 dimensions"):
        head.check_dimension(32)
    plain, _ = resolve(read(tmp_path / "nothing-here"), "", None, 512, 512, 512)
    assert plain.truncate_dim is None and plain.dimension(384) == 384


@pytest.mark.parametrize("value", [0, -8, "64", 1.5, True])
def test_a_truncate_dim_that_is_not_a_positive_integer_fails_start_up(tmp_path, value):
    with pytest.raises(DeclarationError, match="truncate_dim"):
        read(write(tmp_path, {"modules.json": MODULES, "config_sentence_transformers.json": {"truncate_dim": value}}))


@pytest.mark.parametrize("module, message", [
    ({"path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"}, "does not run: sentence_transformers.models.LayerNorm"),
    ({"path": "2_Router", "type": "sentence_transformers.base.modules.router.Router"}, "does not run"),
])
def test_modules_it_cannot_run_fail_start_up_naming_them(tmp_path, module, message):
    with pytest.raises(DeclarationError, match=message):
        read(write(tmp_path, {"modules.json": MODULES + [{"idx": 2, "name": "2", **module}],
                              "1_Pooling/config.json": {"pooling_mode": "mean"}}))


def test_prompts_left_out_of_pooling_are_refused_not_ignored(tmp_path):
    with pytest.raises(DeclarationError, match="include_prompt: false"):
        read(write(tmp_path, {"modules.json": MODULES, "1_Pooling/config.json": {"pooling_mode": "mean", "include_prompt": False}}))


def test_a_plain_checkpoint_is_served_as_sentence_transformers_serves_one(tmp_path):
    head, notes = resolve(read(tmp_path), "", None, 512, 512, 512)
    assert (head.pooling, head.normalize) == (("mean",), False)
    assert any("no sentence-transformers modules.json" in n for n in notes)


def test_the_environment_overrides_and_says_so():
    head, notes = resolve(Declared(True, ("cls",), normalize=True, max_seq_length=256), "mean+last", False, 512, 512, 512)
    assert (head.pooling, head.normalize) == (("mean", "lasttoken"), False)
    assert any("POOLING=mean+last overrides" in n for n in notes) and any("NORMALIZE=false overrides" in n for n in notes)


def test_max_length_is_the_declared_one_capped_by_positions_and_the_largest_bucket():
    assert resolve(Declared(True, max_seq_length=256), "", None, 512, 512, 512)[0].max_length == 256
    assert resolve(Declared(True), "", None, 10**30, 514, 512)[0].max_length == 512  # tokenizer's "no limit"
    head, notes = resolve(Declared(True, max_seq_length=8192), "", None, 8192, 8192, 512)
    assert head.max_length == 512 and any("largest bucket (512) cuts" in n for n in notes)


SPARSE = [{"idx": 0, "name": "0", "path": "",
           "type": "sentence_transformers.sparse_encoder.modules.mlm_transformer.MLMTransformer"},
          {"idx": 1, "name": "1", "path": "1_SpladePooling",
           "type": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"}]


def test_a_sparse_encoder_is_read_as_splade_with_its_top_k_and_prompts(tmp_path):
    from embedserve.model.declared import Splade, for_task
    from embedserve.model.encoder import task_of

    d = read(write(tmp_path, {"modules.json": SPARSE, "1_SpladePooling/config.json": {
        "pooling_strategy": "sum", "activation_function": "log1p_relu", "word_embedding_dimension": 30522},
        "config_sentence_transformers.json": {"model_type": "SparseEncoder", "max_active_dims": 64,
                                              "prompts": {"query": "q: "}}}))
    assert d.splade == Splade("sum", "log1p_relu", 64) and d.prompts == {"query": "q: "}
    assert task_of(object(), "auto", sparse=True) == "sparse"
    head, _ = resolve(for_task(d, "sparse"), "", None, 512, 512, 512)
    assert head.splade == d.splade and head.describe()["pooling"] == "splade_sum"
    with pytest.raises(DeclarationError, match="TASK=embed: this model is a SparseEncoder"):
        for_task(d, "embed")
    with pytest.raises(DeclarationError, match="POOLING and NORMALIZE do not apply"):
        resolve(d, "mean", None, 512, 512, 512)


def test_the_transformer_module_with_fill_mask_is_an_mlm_and_task_sparse_serves_a_plain_checkpoint(tmp_path):
    from embedserve.model.declared import Splade, for_task

    modules = [{**SPARSE[0], "type": "sentence_transformers.base.modules.transformer.Transformer"}, SPARSE[1]]
    d = read(write(tmp_path / "a", {"modules.json": modules, "sentence_bert_config.json": {"transformer_task": "fill-mask"},
                                    "1_SpladePooling/config.json": {}}))
    assert d.splade == Splade("max", "relu", None)
    assert for_task(Declared(), "sparse").splade == Splade()  # SparseEncoder's defaults


@pytest.mark.parametrize("modules, config, message", [
    ([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
      {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
      {"idx": 2, "name": "2", "path": "2_CSR", "type": "sentence_transformers.sparse_encoder.modules.SparseAutoEncoder"}],
     {"model_type": "SparseEncoder"}, "SparseAutoEncoder"),
    ([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder.modules.SparseStaticEmbedding"}],
     {"model_type": "SparseEncoder"}, "SparseStaticEmbedding"),
    ([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.router.Router"}],
     {"model_type": "SparseEncoder"}, "Router"),
    (SPARSE, {"model_type": "SparseEncoder", "max_active_dims": 0}, "max_active_dims 0"),
])
def test_sparse_encoders_it_cannot_serve_fail_start_up_naming_what(tmp_path, modules, config, message):
    files = {"modules.json": modules, "config_sentence_transformers.json": config, "1_SpladePooling/config.json": {}}
    with pytest.raises(DeclarationError, match=message):
        read(write(tmp_path, files))


def test_an_unknown_splade_pooling_is_refused(tmp_path):
    with pytest.raises(DeclarationError, match="SpladePooling mean/relu"):
        read(write(tmp_path, {"modules.json": SPARSE, "1_SpladePooling/config.json": {"pooling_strategy": "mean"}}))

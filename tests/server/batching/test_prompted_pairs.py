"""An LLM reranker's pairs through our tokenizer against sentence-transformers 6.2's own
preprocessing of them (CrossEncoder.preprocess with its default prompt: the chat template
rendered by transformers, tokenized, cut, the template's tail restored), token for token, on the
three layouts of tests/server/model/llm_reranker_models.py; and the pure parts (cut, the
template's pieces, the message format) on their own."""

from __future__ import annotations

import dataclasses

import pytest

from embedserve.batching.prompted_pairs import cut
from embedserve.batching.tokenization import TextTokenizer
from embedserve.errors import InvalidInput
from embedserve.model import declared, llm_prompt, llm_rerank
from tests.server.model.llm_reranker_models import CHATML_TEMPLATE, MAX_LENGTH, build

QUERY = "how far away from the earth is the moon on an average day of the year"
TEXTS = ["the moon is about 384,400 kilometres", "cheese", "the distance between the earth and the moon changes " * 20,
         "paris", "yes no", " lunar  distance\n"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("llm-rerankers"))


def served_tokenizer(model_dir: str, truncate: bool = True, max_length: int | None = None):
    """(our tokenizer, the query as served) as prepare() makes them for TASK=rerank."""
    from transformers import AutoConfig, AutoTokenizer

    hf, config = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
    score = llm_rerank.read(model_dir, config, hf, "rerank")
    head, _ = declared.resolve(declared.read(model_dir), "", None, hf.model_max_length, config.max_position_embeddings,
                               512)
    head, pieces = llm_prompt.for_model(model_dir, hf, config.model_type, dataclasses.replace(head, logit_score=score))
    return TextTokenizer.from_hf(hf, max_length or head.max_length, truncate, False, pieces), head.prompt(None) + QUERY


def judged_rows(model_dir: str, texts: list[str]) -> list[list[int]]:
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(model_dir, device="cpu")
    features = ce.preprocess([(QUERY, t) for t in texts], prompt=ce._resolve_prompt(None, None))
    return [ids[mask.bool()].tolist() for ids, mask in zip(features["input_ids"], features["attention_mask"])]


@pytest.mark.parametrize("layout", ["st", "plain", "plain_text"])
def test_pairs_are_the_rows_sentence_transformers_makes(dirs, layout):
    tok, query = served_tokenizer(dirs[layout])
    ids, lengths = tok.encode_pairs(query, TEXTS)
    want = judged_rows(dirs[layout], TEXTS)
    assert [r[:n].tolist() for r, n in zip(ids, lengths)] == want
    assert max(lengths) == MAX_LENGTH and min(lengths) < MAX_LENGTH  # some cut (their tail restored), some whole
    assert all((r[n:] == tok.pad_id).all() for r, n in zip(ids, lengths))


def test_the_template_is_what_the_rows_are_made_of(dirs):
    """The test above tests something: the chat template's prompt (system text, roles, the
    default prompt as <Instruct>) is in the rows, and the cut row ends with the template's tail."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(dirs["st"])
    tok, query = served_tokenizer(dirs["st"])
    ids, lengths = tok.encode_pairs(query, TEXTS)
    short = hf.decode(ids[1, : lengths[1]].tolist())
    assert short.startswith("<|im_start|>system\nJudge whether") and "<Instruct>: Given a web search" in short
    assert "<Query>: how far" in short and "<Document>: cheese<|im_end|>" in short
    cut_row = hf.decode(ids[2, : lengths[2]].tolist())
    assert cut_row.endswith("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n")
    assert tok.pair_specials > 40  # the prompt's tokens, counted in admission's estimates


def test_truncation_off_refuses_the_long_pair_and_serves_the_short(dirs):
    tok, query = served_tokenizer(dirs["plain"], truncate=False)
    with pytest.raises(InvalidInput, match=r"the pair \(query, texts\[2\]\) is longer than 128 tokens"):
        tok.encode_pairs(query, TEXTS)
    ids, lengths = tok.encode_pairs(query, TEXTS[:2])
    assert [r[:n].tolist() for r, n in zip(ids, lengths)] == judged_rows(dirs["plain"], TEXTS[:2])


def test_a_shorter_max_length_cuts_there_and_restores_the_tail(dirs):
    """The largest bucket below the model's max length: rows cut there, the tail restored."""
    tok, query = served_tokenizer(dirs["plain"], max_length=24)
    ids, lengths = tok.encode_pairs(query, TEXTS)
    assert set(lengths.tolist()) == {24}
    tail = tok._prompted.tail
    assert len(tail) > 2 and all(r[24 - len(tail): 24].tolist() == list(tail) for r in ids)


def test_cut():
    tail = (7, 8)
    assert cut([1, 2, 3, 4, 5], 4, "right", tail) == [1, 2, 7, 8]
    assert cut([1, 2, 3, 4, 5], 4, "left", tail) == [2, 3, 7, 8]
    assert cut([1, 2, 3, 4], 4, "right", tail) == [1, 2, 7, 8]  # a row that reached max_length, as ST restores it
    assert cut([1, 2, 3], 4, "right", tail) == [1, 2, 3]
    assert cut([1, 2, 3, 4, 5], 1, "right", tail) == [8]
    assert cut([1, 2, 3, 4, 5], 4, "right", ()) == [1, 2, 3, 4]


class Rendering:
    """A tokenizer-like object whose apply_chat_template is transformers' Jinja rendering of a
    given template (what `pieces` calls)."""

    def __init__(self, template: str):
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize=False):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.chat_template)
        return rendered[0]


def test_pieces_of_a_template_that_carries_the_pair():
    p = llm_prompt.pieces(Rendering(CHATML_TEMPLATE), "flat", "be brief")
    assert p.before == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>query\n"
    assert p.between == "<|im_end|>\n<|im_start|>document\n"
    assert p.after == "<|im_end|>\n<|im_start|>assistant"  # Jinja drops a template's final newline
    structured = "{% for m in messages %}[{{ m.role }}:{{ m.content[0].text }}]{% endfor %}"
    assert llm_prompt.pieces(Rendering(structured), "structured").render("q", "d") == "[query:q][document:d]"


@pytest.mark.parametrize("template, why", [
    ("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}", "does not reach"),
    ("{% for m in messages %}<{{ m.content | trim }}>{% endfor %}", "changes a pair's texts"),
    ("{% for m in messages | reverse %}<{{ m.content }}>{% endfor %}", "document before the query"),
    ("{{ raise_exception('no pairs') }}", "cannot render"),
])
def test_a_template_that_cannot_carry_the_pair_verbatim_is_refused(template, why):
    with pytest.raises(llm_prompt.TemplateError, match=why):
        llm_prompt.pieces(Rendering(template), "flat")


@pytest.mark.parametrize("template, model_type, said, expected", [
    ("{{ m.content }}", "qwen3", None, "flat"),
    ("{{ m.content[0].text }}", "qwen3", None, "structured"),
    ("{{ m.content }}", "gpt_oss", None, "flat"),
    (None, "qwen3", None, "structured"),
    ("{{ m.content[0].text }}", "qwen3", "flat", "flat"),  # the saved Transformer's word wins
])
def test_message_format_as_sentence_transformers_infers_it(template, model_type, said, expected):
    assert llm_prompt.message_format(template, model_type, said) == expected


def test_a_tokenizer_that_truncates_on_the_left_cuts_there(dirs, tmp_path):
    """truncation_side "left" (tokenizer_config.json): the prompt's start is cut, as transformers
    cuts it for sentence-transformers, and the rows still equal its own."""
    import json
    import shutil

    left = tmp_path / "left"
    shutil.copytree(dirs["plain"], left)
    config = json.loads((left / "tokenizer_config.json").read_text())
    (left / "tokenizer_config.json").write_text(json.dumps({**config, "truncation_side": "left"}))
    tok, query = served_tokenizer(str(left))
    assert tok._prompted.pieces.truncation_side == "left"
    ids, lengths = tok.encode_pairs(query, TEXTS)
    rows = [r[:n].tolist() for r, n in zip(ids, lengths)]
    assert rows == judged_rows(str(left), TEXTS)
    right, _ = served_tokenizer(dirs["plain"])
    cut_right = right.encode_pairs(query, TEXTS)[0][2].tolist()
    assert rows[2][:4] != cut_right[:4]  # the long pair lost its start, not its end

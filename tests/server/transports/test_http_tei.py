"""TEI's routes (transports/http_tei.py) on a real server with the packaged model: /tokenize
against the model's Hugging Face tokenizer, /decode round trips, /similarity against
sentence-transformers' cosine, POST / with both of TEI's payloads, huggingface_hub's
InferenceClient(base_url=...), bad input, and schemathesis over the new operations. The same routes
in front ends (FRONTENDS=2, with a prompt): tests/server/test_dimensions_and_encodings.py."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.server.transports.test_http_api import post


def hf_tokens(tok, text: str, max_length: int | None = 256, add_special_tokens: bool = True) -> list[dict]:
    """What /tokenize should answer for `text` (the prompt already in it), from the HF tokenizer."""
    enc = tok(text, return_offsets_mapping=True, return_special_tokens_mask=True, add_special_tokens=add_special_tokens,
              truncation=max_length is not None, max_length=max_length)
    out = []
    for i, token, special, (start, stop) in zip(enc["input_ids"], tok.convert_ids_to_tokens(enc["input_ids"]),
                                                enc["special_tokens_mask"], enc["offset_mapping"]):
        out.append({"id": i, "text": token, "special": True, "start": None, "stop": None} if special else
                   {"id": i, "text": text[start:stop], "special": False, "start": start, "stop": stop})
    return out


TEXTS = ["Hello, World!", "Crème brûlée — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and emoji 🙂 ok", "tokenizers split unbelievably long words"]


def test_tokenize_is_what_the_model_reads(default_server, reference):
    code, _, body = post(default_server.http + "/tokenize", {"inputs": TEXTS})
    assert code == 200
    assert body == [hf_tokens(reference.tok, t) for t in TEXTS]
    code, _, one = post(default_server.http + "/tokenize", {"inputs": TEXTS[1], "add_special_tokens": False})
    assert code == 200 and one == [hf_tokens(reference.tok, TEXTS[1], add_special_tokens=False)]
    assert not any(t["special"] for t in one[0])


def test_tokenize_cuts_where_embedding_cuts(default_server, reference):
    long = "word " * 400
    code, _, cut = post(default_server.http + "/tokenize", {"inputs": long})
    assert code == 200 and len(cut[0]) == 256 and cut == [hf_tokens(reference.tok, long)]
    code, _, whole = post(default_server.http + "/tokenize", {"inputs": long, "truncate": False})
    assert code == 200 and whole == [hf_tokens(reference.tok, long, max_length=None)] and len(whole[0]) == 402


def test_decode_round_trips(default_server, reference):
    ids = [reference.tok(t)["input_ids"] for t in TEXTS]
    code, _, texts = post(default_server.http + "/decode", {"ids": ids})
    assert code == 200 and texts == [reference.tok.decode(i, skip_special_tokens=True) for i in ids]
    assert texts[0] == "hello, world!"  # the uncased model's tokenizer lower-cases
    code, _, one = post(default_server.http + "/decode", {"ids": ids[0], "skip_special_tokens": False})
    assert code == 200 and one == [reference.tok.decode(ids[0], skip_special_tokens=False)]
    assert one[0].startswith("[CLS]") and one[0].endswith("[SEP]")


def test_similarity_is_sentence_transformers_cosine(default_server, reference):
    from sentence_transformers.util import cos_sim

    source, others = "A man is eating food.", ["A man is eating a piece of bread.", "A monkey plays drums.", "Food."]
    judge = cos_sim(reference.st.encode(source), reference.st.encode(others))[0].numpy()
    body = {"inputs": {"source_sentence": source, "sentences": others}}
    for path, payload in (("/similarity", body), ("/", body), ("/similarity", {**body, "parameters": {"truncate": True}})):
        code, _, got = post(default_server.http + path, payload)
        assert code == 200, got
        assert np.abs(np.array(got) - judge).max() <= 1e-5, path


def test_root_route_takes_the_embed_payload_too(default_server, reference):
    texts = ["root route", "second text"]
    judge = reference.st.encode(texts, truncate_dim=64, normalize_embeddings=True)
    code, _, got = post(default_server.http + "/", {"inputs": texts, "dimensions": 64})
    assert code == 200 and np.abs(np.array(got) - judge).max() <= 1e-5
    code, _, got = post(default_server.http + "/", {"inputs": texts[0]})
    assert code == 200 and np.abs(np.array(got) - reference.st.encode(texts[:1])).max() <= 1e-5


HF_CLIENT = """
import json, sys
import numpy as np
from huggingface_hub import InferenceClient
client = InferenceClient(base_url=sys.argv[1])
similarity = client.sentence_similarity("A man is eating food.", ["A man is eating pasta.", "A cheetah runs."])
vector = client.feature_extraction("embeddings for everyone")
print(json.dumps({"similarity": list(similarity), "vector": np.asarray(vector).tolist()}))
"""


def test_huggingface_hub_client(default_server, reference):
    """InferenceClient(base_url=...) as a user runs it (its own process, no HF_HUB_OFFLINE: it
    refuses every URL offline, loopback too): sentence_similarity (422 before this route) and
    feature_extraction both post to /."""
    from sentence_transformers.util import cos_sim

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    out = subprocess.run([sys.executable, "-c", HF_CLIENT, default_server.http], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    st = reference.st
    judge = cos_sim(st.encode("A man is eating food."), st.encode(["A man is eating pasta.", "A cheetah runs."]))[0]
    assert np.abs(np.array(got["similarity"]) - judge.numpy()).max() <= 1e-5
    assert np.abs(np.array(got["vector"]).reshape(-1) - st.encode("embeddings for everyone")).max() <= 1e-5


@pytest.mark.parametrize("path, body, status, names", [
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 422, "sentences"),
    ("/", {"inputs": {"source_sentence": "a", "sentences": []}}, 422, "sentences"),
    ("/similarity", {"inputs": {"source_sentence": "  ", "sentences": ["b"]}}, 422, "source_sentence"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"prompt_name": "nope"}},
     400, "unknown prompt_name"),
    ("/decode", {"ids": [[101, 30522]]}, 400, "outside the vocabulary [0, 30522)"),
    ("/decode", {"ids": [101, -1]}, 422, "ids"),
    ("/decode", {"ids": []}, 200, ""),  # one empty list decodes to "", as TEI
    ("/decode", {"ids": [[]] * 600}, 422, "at most 512 items"),  # the schema states MAX_TEXTS_PER_REQUEST
    ("/tokenize", {"inputs": []}, 422, "inputs"),
    ("/tokenize", {"inputs": "x", "prompt_name": "query"}, 400, "unknown prompt_name 'query'"),
    ("/tokenize", {"inputs": "word " * 1100 * 16, "truncate": False}, 400, "truncation is off"),
    ("/", {"inputs": "x", "dimensions": 385}, 400, "dimensions=385 exceeds the model's 384"),
])
def test_bad_input_is_named_and_the_server_keeps_serving(default_server, path, body, status, names):
    code, _, reply = post(default_server.http + path, body)
    assert code == status and names in json.dumps(reply), reply
    assert post(default_server.http + "/tokenize", {"inputs": "still serving"})[0] == 200


def test_openapi_schemathesis_over_the_tei_routes(default_server):
    """No 5xx, and answers as the OpenAPI document says, for generated bodies."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(default_server.http + "/openapi.json")
    for path in ("/tokenize", "/decode", "/similarity", "/"):
        operation = schema[path]["POST"]

        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=operation.as_strategy())
        def run(case):
            case.call_and_validate()

        run()

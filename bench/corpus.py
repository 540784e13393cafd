"""A seeded, mixed-length corpus: short queries, titles and sentences, and passages with a long
tail up to (and past) 512 tokens — the shape of real embedding traffic."""

from __future__ import annotations

import numpy as np

# Common English words (tokenize to ~1.2 word-pieces each with BERT vocabularies).
_WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face others level office door health person art war history party result change morning reason
research girl guy moment air teacher force education foot boy age policy process music market
sense nation plan college interest death experience effect use class control care field
development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season
society tax director position player record paper space ground form event official matter
center couple site project activity star table need court oil situation cost industry figure
street image phone data picture practice piece land product doctor wall patient worker news test
movie north love support technology step baby computer type attention film tree source organization
hair window evidence population site rule embedding vector search retrieval kubernetes cluster
running shoes weather recipe travel hotel flight battery laptop camera garden coffee""".split()

KINDS = (  # (share, min words, max words)
    ("query", 0.45, 2, 10),
    ("title", 0.30, 10, 35),
    ("passage", 0.20, 35, 180),
    ("long", 0.05, 180, 520),
)


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    shares = np.array([k[1] for k in KINDS])
    kinds = rng.choice(len(KINDS), size=n, p=shares / shares.sum())
    texts = []
    for k in kinds:
        _, _, lo, hi = KINDS[k]
        words = int(rng.integers(lo, hi + 1))
        texts.append(" ".join(rng.choice(_WORDS, size=words)))
    return texts

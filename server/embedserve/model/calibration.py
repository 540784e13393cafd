"""QUANTIZE_RANGE=calibrated: the model's own vectors of a fixed corpus, from which int8 and uint8
take their range per dimension (sentence-transformers' `quantize_embeddings(...,
calibration_embeddings=...)`: each dimension's min and max over them). A fixed range of [-1, 1]
spreads a unit vector's components, most of them within ±0.2, over a few dozen of the 256 levels
(61 on the packaged MiniLM); the calibrated ranges use them all.

The same on every pod of a model revision: the corpus is fixed (CORPUS, made here, its digest in
the key), the vectors are computed in float32 (on the CPU, whatever the pod serves in: a GPU's
bf16 would differ by pod type), and the file is keyed by the model's revision and how it is
served, not by the device. `python -m embedserve.prefetch` computes it into MODEL_CACHE_DIR when
it fills the cache; a pod that finds none computes it at start-up and saves it for the others
(embedserve.calibrate).

File: <MODEL_CACHE_DIR>/embedfleet-calibration/<sha256 of the key>.npz: `embeddings` (float32
[len(CORPUS), model dimensions]) and `key` (its key as JSON), stored uncompressed. A writer of
the cache can change the ranges (make codes coarse or clipped: /health's digest says which a pod
uses), not run code nor make a pod allocate more than the file holds (`read` checks each
member's header before loading it, with allow_pickle=False): a file that is not such an
archive, holds another key, another shape or a value that is not finite, is ignored with a
warning and computed again."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import math
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SCHEMA = 1
DIRECTORY = "embedfleet-calibration"
MAX_FILE_BYTES = 64 << 20  # 512 rows of 8,192 float32 dimensions are 16 MiB


class Unusable(ValueError):
    """Why a calibration file cannot be used."""


# The corpus: 512 texts, short and long (passages of several sentences), questions, statements,
# titles, keyword queries, numbers and code, across many domains, so each dimension's extremes are a model's usual ones. Made by
# fixed arithmetic from the lists below (no random generator whose sequence a Python release
# could change); its digest is part of the file's key.
_DOMAINS = {
    "cooking": (("the chef", "my grandmother", "a home cook", "the bakery"), ("roasts", "simmers", "bakes", "seasons"),
                ("garlic and rosemary potatoes", "a sourdough loaf", "lentil soup", "caramelized onions"),
                ("for forty minutes", "in a cast iron pan", "over low heat", "before serving")),
    "finance": (("the central bank", "an index fund", "the startup", "my accountant"), ("raises", "hedges", "reports", "cuts"),
                ("interest rates", "quarterly earnings", "currency risk", "operating costs"),
                ("after the inflation report", "by two percent", "in the fourth quarter", "despite the downturn")),
    "medicine": (("the cardiologist", "a nurse", "the clinical trial", "the patient"), ("prescribes", "measures", "monitors", "reduces"),
                 ("blood pressure", "a low dose of aspirin", "insulin resistance", "the side effects"),
                 ("twice a day", "after surgery", "in older adults", "for six weeks")),
    "software": (("the compiler", "our CI pipeline", "the database", "a junior developer"), ("caches", "refactors", "deploys", "indexes"),
                 ("the query planner", "a memory leak", "the REST endpoint", "unit tests"),
                 ("on every commit", "in production", "behind a feature flag", "without downtime")),
    "sports": (("the striker", "the home team", "a marathon runner", "the coach"), ("scores", "trains", "defends", "wins"),
               ("the championship", "a penalty kick", "the final lap", "three straight games"),
               ("in extra time", "at high altitude", "before the playoffs", "on a rainy night")),
    "travel": (("the ferry", "a backpacker", "our tour guide", "the airline"), ("crosses", "books", "explores", "delays"),
               ("the old harbour", "a night train to Vienna", "mountain villages", "the connecting flight"),
               ("during the off season", "at sunrise", "on a tight budget", "for a week")),
    "law": (("the court", "a tenant", "the regulator", "defense counsel"), ("rules on", "appeals", "enforces", "drafts"),
            ("the contract dispute", "a data protection fine", "the eviction notice", "new antitrust rules"),
            ("within thirty days", "under federal law", "after a long hearing", "in a landmark case")),
    "science": (("the telescope", "a graduate student", "the enzyme", "the research team"), ("observes", "catalyzes", "models", "measures"),
                ("distant galaxies", "protein folding", "ocean temperatures", "quantum entanglement"),
                ("with unprecedented precision", "at the molecular level", "over a decade", "in the lab")),
    "home": (("the plumber", "my neighbour", "the landlord", "a smart thermostat"), ("fixes", "paints", "insulates", "replaces"),
             ("the leaking faucet", "the attic", "a broken window", "the kitchen cabinets"),
             ("over the weekend", "before winter", "for a few hundred dollars", "without a permit")),
    "music": (("the orchestra", "a jazz trio", "the producer", "my cousin"), ("records", "rehearses", "remixes", "performs"),
              ("a new album", "Beethoven's ninth", "the bass line", "an acoustic set"),
              ("in a small club", "live on the radio", "in one take", "to a sold-out crowd")),
    "nature": (("the wolves", "a hummingbird", "the glacier", "old oak trees"), ("migrate", "feeds on", "retreats from", "shelter"),
               ("the northern valley", "wildflower nectar", "the coastline", "nesting birds"),
               ("every spring", "as the climate warms", "at dusk", "for centuries")),
    "education": (("the teacher", "a first-year student", "the university", "online courses"), ("explains", "grades", "teaches", "revises"),
                  ("linear algebra", "the history essay", "reading comprehension", "a chemistry lab"),
                  ("with simple examples", "before the exam", "in small groups", "for free")),
    "shopping": (("the customer", "an online store", "the outlet", "my sister"), ("returns", "orders", "compares", "discounts"),
                 ("wireless headphones", "a winter jacket", "running shoes", "a coffee grinder"),
                 ("with free shipping", "during the sale", "after two weeks", "in three colours")),
    "politics": (("the senator", "the city council", "voters", "the prime minister"), ("debates", "passes", "rejects", "proposes"),
                 ("the housing bill", "a carbon tax", "election reforms", "the budget"),
                 ("in a close vote", "after months of talks", "before the summit", "amid protests")),
}
_TEMPLATES = (
    "{s} {a} {o} {p}.",
    "How does {s} handle {o} {p}?",
    "{o}",
    "Why {s} {a} {o}",
    "{O}: what you need to know",
    "I read that {s} {a} {o}, but I am not sure it works {p}.",
    "best way {o} {p}",
    "Yesterday {s} {a} {o} {p}, which surprised everyone who had followed the story closely for years.",
)
_STANDALONE = (
    "hi", "ok thanks", "What time is it in Tokyo?", "Error 404: page not found", "SELECT name FROM users WHERE id = 42;",
    "def add(a, b): return a + b", "The quick brown fox jumps over the lazy dog.", "¿Dónde está la estación de tren?",
    "Le chat dort sur le canapé depuis ce matin.", "Die Besprechung wurde auf Donnerstag verschoben.",
    "今日はとても暑いです。", "北京是中国的首都。", "Ответ на этот вопрос не так прост.", "3.14159 is roughly pi",
    "Call me at 555-0123 after 6 pm.", "Invoice #2024-117 is due on March 3.", "The meeting is cancelled.",
    "Terms and conditions apply; see section 4(b) for exclusions.", "lol that was hilarious 😂",
    "Is it safe to eat raw cookie dough?", "Mitochondria are the powerhouse of the cell.",
    "Please reset my password", "The Eiffel Tower was completed in 1889.", "Water boils at 100 degrees Celsius at sea level.",
    "Buy 2 get 1 free", "Photosynthesis converts light energy into chemical energy.", "cheap flights to lisbon",
    "What is the capital of Australia?", "The train was late again, so I walked.", "kubectl get pods -n embeddings",
    "An apple a day keeps the doctor away.", "The stock fell 12% after the earnings call.",
    "Shakespeare wrote Hamlet around 1600.", "symptoms of vitamin D deficiency", "how to tie a bowline knot",
    "The contract terminates automatically upon breach.", "Our Wi-Fi password is on the fridge.",
    "Gradient descent minimizes a loss function step by step.", "She won the Nobel Prize in Chemistry.",
    "The recipe needs two eggs, flour, and a pinch of salt.", "Traffic is heavy on the highway this morning.",
    "Neural networks learn representations from data.", "He apologized for the misunderstanding.",
    "What does GDP stand for?", "The museum is closed on Mondays.", "I love this song!", "no",
    "A long, winding paragraph about nothing in particular, written to see how a model treats rambling text "
    "that goes on and on, mentioning weather, breakfast, a dog named Biscuit, and the vague plans for Sunday.",
    "Refund policy: items may be returned within 30 days with a receipt.", "The printer is out of toner.",
    "Climate change is raising sea levels worldwide.", "fast charging usb-c laptop 65w",
    "The patient reported mild headaches and dizziness.", "Congratulations on your promotion!",
    "Where can I find the nearest pharmacy?", "The sun rises in the east.", "Lorem ipsum dolor sit amet.",
    "The bridge will be closed for repairs until June.", "We regret to inform you that your application was unsuccessful.",
    "Two plus two equals four.", "The volcano erupted without warning.", "Keep calm and carry on.",
    "The algorithm runs in O(n log n) time.", "Thank you for your order!",
)


PASSAGES = 128  # of the corpus's 512 texts: 2 to 9 of its sentences run together, as documents are


def _corpus() -> tuple[str, ...]:
    texts = list(_STANDALONE)
    domains = list(_DOMAINS.values())
    i = 0
    seen = set(texts)
    while len(texts) < 512 - PASSAGES:
        h = (i * 2654435761) % 2**32  # Knuth's multiplicative hash: its bits pick the words
        subjects, actions, objects, places = domains[i % len(domains)]
        template = _TEMPLATES[(h >> 8) % len(_TEMPLATES)]
        s, a, o, p = subjects[h % 4], actions[(h >> 2) % 4], objects[(h >> 4) % 4], places[(h >> 6) % 4]
        text = template.format(s=s, a=a, o=o, p=p, O=o[0].upper() + o[1:])
        text = text[0].upper() + text[1:] if template[0] == "{" and i % 3 else text
        if text not in seen:
            seen.add(text)
            texts.append(text)
        i += 1
    sentences = [t for t in texts[len(_STANDALONE):] if t.endswith((".", "?"))]
    for j in range(PASSAGES):
        count = 2 + (j * 5) % 8
        texts.append(" ".join(sentences[(j * 37 + k * 11) % len(sentences)] for k in range(count)))
    return tuple(texts)


CORPUS = _corpus()
CORPUS_DIGEST = hashlib.sha256("\n".join(CORPUS).encode()).hexdigest()[:16]


def key(revision: str, served: dict, weights: str = "") -> dict:
    """The file's key: the model's revision (model.warm_key.revision), the digest of the weights'
    contents where the revision names them by size alone (`weights`: embedserve.calibrate's
    contents_digest; "" for a hub snapshot, whose commit names them), and how its vectors are
    formed (`served`: pooling, normalization, Dense layers, max length, the default prompt's text,
    tokens left out of pooling), with the corpus and this schema. No device, dtype or library
    version: every pod of a revision reads the same file."""
    return {"schema": SCHEMA, "corpus": CORPUS_DIGEST, "model_revision": revision, "weights": weights,
            "served": served}


def file_for(cache_dir: str | os.PathLike, key_: dict) -> Path:
    name = hashlib.sha256(json.dumps(key_, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir) / DIRECTORY / f"{name}.npz"


def digest(embeddings: np.ndarray) -> str:
    """What /health and gRPC HealthCheck name the calibration by: its float32 bytes' sha256
    (first 16 hex digits). Equal digests, equal ranges."""
    return hashlib.sha256(np.ascontiguousarray(embeddings, dtype="<f4").tobytes()).hexdigest()[:16]


def check(embeddings: object, dim: int | None = None) -> np.ndarray:
    """Calibration embeddings a server can quantize by, or Unusable saying why: float32 [len(CORPUS),
    d] (d = `dim` where known) and finite. A dimension with no spread (its max equals its min: a
    dead dimension of the model, or a forged file) is a warning: quantization gives it one level
    (as sentence-transformers does), which is what such a dimension carries."""
    if not isinstance(embeddings, np.ndarray) or embeddings.dtype != np.float32 or embeddings.ndim != 2:
        raise Unusable(f"not float32 rows ({getattr(embeddings, 'dtype', type(embeddings).__name__)}, "
                       f"{getattr(embeddings, 'shape', '?')})")
    if embeddings.shape[0] != len(CORPUS) or (dim is not None and embeddings.shape[1] != dim) or not embeddings.shape[1]:
        raise Unusable(f"shape {embeddings.shape}, expected ({len(CORPUS)}, {dim if dim is not None else 'd'})")
    if not np.isfinite(embeddings).all():
        raise Unusable("values that are not finite")
    flat = np.flatnonzero(embeddings.max(axis=0) <= embeddings.min(axis=0))
    if flat.size:
        log.warning("calibration: %d of %d dimensions have no spread over the corpus (the first: %d): int8/uint8 "
                    "give each of them one level", flat.size, embeddings.shape[1], int(flat[0]))
    return embeddings


MAX_KEY_CHARS = 4096  # the key as JSON: a few hundred characters
MEMBERS = {"embeddings.npy", "key.npy"}  # what np.savez writes for `write`


def _header(member) -> tuple[tuple[int, ...], np.dtype]:
    """An .npy member's shape and dtype, from its header alone (nothing of the data allocated);
    only the header format `write` produces (1.0)."""
    version = np.lib.format.read_magic(member)
    if version != (1, 0):
        raise Unusable(f"an .npy header of version {version}, expected (1, 0)")
    shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
    if fortran:
        raise Unusable("a Fortran-ordered array")
    return shape, dtype


def _load(archive: zipfile.ZipFile, name: str, shape_ok, what: str) -> np.ndarray:
    """Member `name`, its header checked by `shape_ok(shape, dtype)` before anything is allocated,
    and its size against the member's own (so what is read is what the header claims)."""
    info = archive.getinfo(name)
    with archive.open(info) as member:
        shape, dtype = _header(member)
        if not shape_ok(shape, dtype):
            raise Unusable(f"{what}: {dtype} {shape}")
        if member.tell() + math.prod(shape) * dtype.itemsize != info.file_size:
            raise Unusable(f"{what}: {info.file_size} bytes for {dtype} {shape}")
    with archive.open(info) as member:
        return np.lib.format.read_array(member, allow_pickle=False)


def read(path: Path, key_: dict, dim: int | None = None) -> np.ndarray | None:
    """The calibration saved at `path` for `key_`; None when there is none (or it cannot be used:
    a warning naming it and why). Nothing a forged file claims is allocated before it is checked:
    the archive holds exactly `write`'s two members, stored (not compressed: a few bytes of
    deflate may claim terabytes), within MAX_FILE_BYTES; the key is a string of at most
    MAX_KEY_CHARS; the embeddings' header says float32 [len(CORPUS), d] (d = `dim` where known)
    and their member holds exactly that many bytes."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise Unusable(f"over {MAX_FILE_BYTES} bytes")
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            if sorted(m.filename for m in members) != sorted(MEMBERS):
                raise Unusable(f"members {[m.filename for m in members][:4]}, expected {sorted(MEMBERS)}")
            for m in members:
                if m.compress_type != zipfile.ZIP_STORED or m.file_size > MAX_FILE_BYTES:
                    raise Unusable(f"{m.filename}: compressed or over {MAX_FILE_BYTES} bytes (written stored)")
            stored = _load(archive, "key.npy", lambda shape, dt: shape == () and dt.kind == "U"
                           and dt.itemsize <= 4 * MAX_KEY_CHARS, "the key")
            if json.loads(str(stored)) != key_:
                raise Unusable("written for another model revision, serving or corpus")
            embeddings = _load(archive, "embeddings.npy", lambda shape, dt: dt == np.dtype("<f4") and len(shape) == 2
                               and shape[0] == len(CORPUS) and shape[1] == (dim or shape[1]) > 0, "the embeddings")
            return check(embeddings, dim)
    except FileNotFoundError:
        return None
    except Unusable as e:
        log.warning("calibration: ignoring %s: %s; computing it again", path, e)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError, MemoryError) as e:
        log.warning("calibration: ignoring %s (%s: %s); computing it again", path, type(e).__name__, e)
    return None


def write(path: Path, key_: dict, embeddings: np.ndarray) -> np.ndarray | None:
    """Save `embeddings` at `path` unless a usable calibration is there already: the first writer
    wins, so pods that start together and each compute one all serve the same (the one saved
    first: `os.link` of a whole temporary file, which fails where a file exists, unlike a rename,
    which would let the last writer replace what earlier pods already serve). → the calibration
    now at `path` (ours, or the one found there); None, with one line, when the cache cannot be
    written (INFO for a read-only one): this pod keeps its own."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        np.savez(buffer, embeddings=np.ascontiguousarray(embeddings, dtype=np.float32),
                 key=np.array(json.dumps(key_, sort_keys=True)))
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getvalue())
            f.flush()
            os.fsync(f.fileno())
        if not _link(tmp, path):
            found = read(path, key_, embeddings.shape[1])
            if found is not None:
                log.info("calibration: %s was saved by another pod first: serving it", path)
                return found
            os.replace(tmp, path)  # what is there is no usable calibration (read said why): replaced
            tmp = None
    except OSError as e:
        read_only = e.errno in (errno.EROFS, errno.EACCES, errno.EPERM)  # a pre-filled claim mounted readOnly
        log.log(logging.INFO if read_only else logging.WARNING,
                "calibration: cannot save %s (%s): the next pod computes it again", path, e)
        return None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return embeddings


def _link(tmp: str, path: Path) -> bool:
    """Put `tmp` at `path` unless a file is there; False if one is. Where the file system has no
    hard links, a rename after a look (a race between two pods there is the last writer's)."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
            raise
    if path.exists():
        return False
    os.replace(tmp, path)
    return True

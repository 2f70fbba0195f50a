"""A real retrieval server behind Search-QA: HttpRetriever talks to Search-R1 / verl-agent's POST /retrieve.

The API (Search-R1 search_r1/search/retrieval_server.py and retrieval_request.py; verl-agent's
examples/search/retriever/retrieval_server.py, read in lms2004/verl-agent):
request JSON {"queries": [q, ...], "topk": k, "return_scores": true} (Search-R1) or {"query": q, "topk": k,
"return_scores": true} (verl-agent's server, one query); response {"result": [[{"document": {"id": ..., "contents":
"title\\ntext"}, "score": s}, ...]]}, one inner list per query, or bare documents when return_scores is false.
HttpRetriever sends both "query" and "queries" (both servers' pydantic models ignore the field they do not know), reads
the first inner list and returns each document's "contents" (or "title\\ntext" where a fork sends those), so the env
renders them as Search-R1 does. Departures from verl-agent's client (skyrl_gym tools/search.py): one try, no retries
and no shared session pool: a server that is down, times out after `timeout` seconds, answers an HTTP error, non-JSON
or another shape raises RetrievalError (a RuntimeError) whose one-line message names the URL and what was wrong; the
training loop turns an exception from env.step into a dropped trajectory.

make_env(split, seed, url=...) builds a SearchQAEnv that retrieves through the server; its questions, gold answers
and gold passages still come from the embedded fictional corpus (simulators/search_qa.py), so against a Wikipedia
index the questions are unanswerable and gt's passage ids are the returned titles. A real run as in the paper needs
verl-agent's setup instead (the SEED repository's README.md, "Search-Based QA"): the data,
`python examples/data_preprocess/preprocess_search_r1_dataset.py` (NQ + HotpotQA train, the seven Search-R1 test
sets, into ~/data/searchR1_processed_direct/{train,test}.parquet), and the retrieval server, `python
examples/search/searchr1_download.py --local_dir ~/data/searchR1`, `cat part_* > e5_Flat.index`, `gzip -d
wiki-18.jsonl.gz`, then examples/search/retriever/retrieval_launch.sh (e5-base-v2, faiss, --topk 3, port 8000), so
that SEARCH_URL=http://127.0.0.1:8000/retrieve. Feeding those parquet questions to this env is not done here.

Run: python -m adapters.search_server --url http://127.0.0.1:8000/retrieve --query "Who founded Quellon Works?"
"""
import argparse
import json
import urllib.error
import urllib.request

from simulators.search_qa import TOPK, SearchQAEnv

MAX_RESPONSE_BYTES = 20_000_000


class RetrievalError(RuntimeError):
    """The retrieval server could not answer: down, too slow, an HTTP error, non-JSON or the wrong shape."""


def _one_line(text, limit=160):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class HttpRetriever:
    """search(query, topk) -> [passage str] from a Search-R1 / verl-agent /retrieve server at `url`."""

    def __init__(self, url, timeout=10):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"retrieval server URL must start with http:// or https://, got {url!r}")
        self.url, self.timeout = url, timeout

    def search(self, query, topk=TOPK):
        body = json.dumps({"query": query, "queries": [query], "topk": topk, "return_scores": True}).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as error:
            raise self._error(f"answered HTTP {error.code} {error.reason}") from None
        except (TimeoutError, OSError) as error:  # URLError, refused connections and socket timeouts are OSErrors
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                raise self._error(f"did not answer within {self.timeout} s") from None
            raise self._error(f"is unreachable ({_one_line(reason)})") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise self._error(f"answered more than {MAX_RESPONSE_BYTES} bytes")
        try:
            payload = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._error(f"answered non-JSON: {_one_line(raw.decode('utf-8', 'replace'), 80)!r}") from None
        return self._passages(payload)[:topk]

    def _passages(self, payload):
        """The passage strings of the first query's results, or RetrievalError naming the shape."""
        results = payload.get("result") if isinstance(payload, dict) else None
        if isinstance(results, list) and results and isinstance(results[0], list):
            passages = [self._contents(item) for item in results[0]]
            if all(isinstance(p, str) for p in passages):
                return passages
        raise self._error("answered an unexpected shape, expected {'result': [[{'document': {'contents': str}}]]}, "
                          f"got {_one_line(json.dumps(payload)[:200], 120)}")

    @staticmethod
    def _contents(item):
        document = item.get("document", item) if isinstance(item, dict) else None
        if not isinstance(document, dict):
            return None
        if isinstance(document.get("contents"), str):
            return document["contents"]
        if isinstance(document.get("title"), str) and isinstance(document.get("text"), str):
            return f"{document['title']}\n{document['text']}"
        return None

    def _error(self, what):
        return RetrievalError(f"retrieval server {self.url} {what}")


def make_env(split="train", seed=0, url=None, timeout=10, **options):
    """A SearchQAEnv: embedded BM25 when url is None, else retrieving from the server at url (module docstring)."""
    retriever = HttpRetriever(url, timeout) if url else None
    return SearchQAEnv(split, seed, retriever=retriever, **options)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Send one query to a /retrieve server and print the passages.")
    parser.add_argument("--url", default="http://127.0.0.1:8000/retrieve")
    parser.add_argument("--query", required=True)
    parser.add_argument("--topk", type=int, default=TOPK)
    args = parser.parse_args()
    for i, passage in enumerate(HttpRetriever(args.url).search(args.query, args.topk)):
        print(f"Doc {i + 1}: {_one_line(passage, 300)}")

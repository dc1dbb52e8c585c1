"""lm-evaluation-harness's `local-completions` model against the suite (issue 20).

The harness's own client code (lm_eval.models.openai_completions.LocalCompletionsAPI: its
tokenization into token-id prompts, its echo + logprobs request, its parsing of
`token_logprobs`) scores a small multiple-choice task written here. Each choice's loglikelihood
must equal the one the engine gives as a library on the same token ids (`LLM.prompt_logits`,
the server's weight format: `quantization="auto"`), and the default model must pick the right
answer more often than chance.

Slow: it needs the whole suite (tests/e2e/conftest.py) and loads the model a second time in
this process for the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flotilla.libs.common.model_cache import DEFAULT_GGUF_NAME, ensure_default_model
from tests.e2e.conftest import MODEL, SuiteHandle

# (question, right answer, wrong answer): common knowledge against an absurd distractor
TASK = [
    ("The capital of France is", " Paris", " a banana"),
    ("Two plus two equals", " four", " purple"),
    ("The sun rises in the", " east", " refrigerator"),
    ("Water freezes at zero degrees", " Celsius", " of happiness"),
    ("A week has seven", " days", " elephants"),
    ("Cats like to drink", " milk", " gasoline"),
    ("The color of the sky on a clear day is", " blue", " loud"),
    ("Birds can", " fly", " photosynthesize"),
    ("The opposite of hot is", " cold", " Tuesday"),
    ("Monday, Tuesday,", " Wednesday", " spaghetti"),
    ("One, two, three,", " four", " cheese"),
    ("The capital of Italy is", " Rome", " a sandwich"),
    ("We read books in the", " library", " volcano"),
    ("Fish live in", " water", " clouds of sand"),
    ("January is the first month of the", " year", " carrot"),
    ("Doctors work in a", " hospital", " teaspoon"),
    ("Snow is", " white", " delicious metal"),
    ("You wear shoes on your", " feet", " ears"),
    ("The moon orbits the", " Earth", " toaster"),
    ("Bees make", " honey", " bicycles"),
    ("A dog says", " woof", " algebra"),
    ("The largest ocean on Earth is the", " Pacific", " kitchen"),
    ("At night it is", " dark", " triangular"),
    ("To write a letter you use a", " pen", " cloud"),
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer as a transformers directory (from its GGUF), which is what
    the harness's `huggingface` tokenizer backend loads."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    gguf = ensure_default_model()
    assert gguf.name == DEFAULT_GGUF_NAME
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(path)
    return path


@pytest.mark.slow
def test_local_completions_loglikelihoods_equal_the_engines(
    suite: SuiteHandle, hf_tokenizer: Path
) -> None:
    lm_eval_api = pytest.importorskip("lm_eval.models.openai_completions")
    torch = pytest.importorskip("torch")
    from lm_eval.api.instance import Instance

    from flotilla.services.engine.llm import LLM

    lm = lm_eval_api.LocalCompletionsAPI(
        base_url=f"{suite.base_url}/completions",
        model=MODEL,
        tokenizer_backend="huggingface",
        tokenizer=str(hf_tokenizer),
        batch_size=8,
        max_retries=1,
    )
    pairs = [(q, choice) for q, right, wrong in TASK for choice in (right, wrong)]
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(pairs)
    ]
    got = lm.loglikelihood(requests)
    assert len(got) == len(pairs)

    llm = LLM("default", quantization="auto")  # the server's own defaults on CPU
    for (context, continuation), (loglik, _) in zip(pairs, got, strict=True):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        ids = context_ids + continuation_ids
        logprobs = torch.log_softmax(torch.as_tensor(llm.prompt_logits(ids)), -1)
        start = len(context_ids)
        want = sum(logprobs[t - 1, ids[t]].item() for t in range(start, len(ids)))
        assert loglik == pytest.approx(want, abs=1e-4), (context, continuation)

    right = sum(got[2 * i][0] > got[2 * i + 1][0] for i in range(len(TASK)))
    accuracy = right / len(TASK)
    # chance is 0.5 with two choices; 18 of 24 or more happens by chance with p ~ 0.01
    assert accuracy >= 0.75, accuracy

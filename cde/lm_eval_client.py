"""lm-eval (EleutherAI's harness, 0.4.13) against a running server: `python -m cde.lm_eval_client`
takes lm-eval's own command line, with one more model type registered.

* A causal model needs nothing of ours: lm-eval's `local-completions` (loglikelihood and
  generation) and `local-chat-completions` (generation) work as they are; pass
  `tokenizer_backend=remote` and lm-eval tokenizes through the server's `/tokenize`.
* A block-diffusion (Steerling) model scores a continuation given a context (the public
  package's Monte Carlo ELBO), and lm-eval's loglikelihood payload does not say where the
  context ends. `cde-completions` is `local-completions` that adds it (`echo_context_tokens`),
  with the remote tokenizer by default. Its `is_greedy` reads True (each scored token's only
  listed alternative is itself; the package's wrapper always says False).

    python -m cde.lm_eval_client --model cde-completions \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=steerling-small \\
        --tasks lambada_openai --limit 20

lm-eval is a test / evaluation dependency (requirements-test.txt), imported only here.
"""

from __future__ import annotations

from typing import Any

MODEL_NAME = "cde-completions"


def register() -> type:
    """Register `cde-completions` with lm-eval's model registry (idempotent); returns the class."""
    import lm_eval.models  # noqa: F401  (lm-eval's own models first: it imports them only into an empty registry)
    from lm_eval.api.registry import MODEL_REGISTRY, register_model
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    if MODEL_NAME in MODEL_REGISTRY:
        return MODEL_REGISTRY.get(MODEL_NAME)

    @register_model(MODEL_NAME)
    class CdeCompletions(LocalCompletionsAPI):
        def __init__(self, tokenizer_backend: str = "remote", **kwargs: Any):
            super().__init__(tokenizer_backend=tokenizer_backend, **kwargs)
            self._context_of: dict[tuple[int, ...], int] = {}

        def batch_loglikelihood_requests(self, chunks):
            inputs, ctxlens, cache_keys = super().batch_loglikelihood_requests(chunks)
            for tokens, ctxlen in zip(inputs, ctxlens):
                self._context_of[tuple(tokens)] = ctxlen
            return inputs, ctxlens, cache_keys

        def _create_payload(self, messages, generate=False, gen_kwargs=None, seed=1234, eos=None, **kwargs):
            payload = super()._create_payload(messages, generate=generate, gen_kwargs=gen_kwargs, seed=seed,
                                              eos=eos, **kwargs)
            if not generate:
                prompts = messages if messages and isinstance(messages[0], list) else [messages]
                if len(prompts) != 1:
                    raise ValueError("cde-completions scores one request per call: use batch_size=1")
                payload["echo_context_tokens"] = self._context_of.pop(tuple(prompts[0]))
            return payload

    return CdeCompletions


def main() -> None:
    register()
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()

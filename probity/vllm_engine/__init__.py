"""The vLLM engine backend: a child process that runs vLLM in-process and speaks probity's pipe.

Run only by the interpreter of `.venv-vllm` (`make setup-vllm`); nothing in the server imports it."""

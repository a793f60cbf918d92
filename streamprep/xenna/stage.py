"""The tokenization stage: a thin cosmos-xenna adapter over `streamprep.shards.run_task`."""
from __future__ import annotations

from typing import Any

from cosmos_xenna.pipelines import v1 as xenna

from streamprep.shards import ShardTask, run_task


class TokenizeStage(xenna.Stage):
    """One ShardTask in, one result dict out. The tokenizer is loaded once per worker in `setup()`."""

    def __init__(self, tokenizer_path: str, cpus: float = 1.0, chat: bool = False):
        self.tokenizer_path = tokenizer_path
        self.chat = chat  # SFT: load the chat tokenizer (tokenizer.json + chat template) instead
        self.cpus = cpus
        self.tokenizer: Any = None

    @property
    def required_resources(self) -> xenna.Resources:
        return xenna.Resources(cpus=self.cpus, gpus=0)

    def setup(self, worker_metadata: xenna.WorkerMetadata) -> None:
        if self.chat:
            from streamprep.sft import load_chat_tokenizer

            self.tokenizer = load_chat_tokenizer(self.tokenizer_path)
            return
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(self.tokenizer_path)

    def process_data(self, in_data: list[ShardTask]) -> list[dict[str, Any]]:
        return [run_task(task, self.tokenizer) for task in in_data]

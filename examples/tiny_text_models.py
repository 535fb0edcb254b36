"""Build tiny text models and datasets offline, for the command line's text families.

    python examples/tiny_text_models.py llama tiny-llama   # for examples/recipes/tiny_llama_offline.yaml
    python examples/tiny_text_models.py bert tiny-bert

``llama`` writes a tiny Llama (`LlamaForCausalLM` from a `LlamaConfig`) with a word-level tokenizer that
carries a chat template, two experts fine-tuned from it for a few steps on their own task's text
(``add``: "add 3 4 = 7"; ``sort``: "sort 3 1 2 = 1 2 3"), and each task's text as a `DatasetDict` saved
with ``save_to_disk`` (``train`` / ``test`` splits; ``sort`` also as chat messages in a ``messages``
column). ``bert`` writes a tiny `BertModel` with a WordPiece-style tokenizer, two experts (the base plus a
seeded random task vector: an encoder's experts would carry their own heads) and the same text datasets.
Nothing is downloaded; a run takes a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

TASKS = ("add", "sort")
WORDS = ["add", "sort", "=", *map(str, range(19))]
#: A chat template (Jinja) for the tiny tokenizer: one line per message, the role first.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def task_texts(task: str, count: int, seed: int) -> list[str]:
    """`count` texts of `task` (``add``: "add a b = a+b"; ``sort``: "sort ... = the digits sorted")."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(count):
        digits = [int(d) for d in rng.integers(0, 10, rng.integers(2, 5))]
        if task == "add":
            a, b = digits[:2]
            texts.append(f"add {a} {b} = {a + b}")
        else:
            texts.append("sort " + " ".join(map(str, digits)) + " = " + " ".join(map(str, sorted(digits))))
    return texts


def _save_data(folder: str, chat: bool) -> None:
    import datasets

    for index, task in enumerate(TASKS):
        splits = {}
        for split, count, seed in (("train", 48, 100 + index), ("test", 24, 200 + index)):
            texts = task_texts(task, count, seed)
            columns: dict[str, list] = {"text": texts}
            if chat:  # the same examples as a user prompt and the assistant's answer
                columns["messages"] = [[{"role": "user", "content": text.split(" = ")[0]},
                                        {"role": "assistant", "content": text.split(" = ")[1]}] for text in texts]
            splits[split] = datasets.Dataset.from_dict(columns)
        datasets.DatasetDict(splits).save_to_disk(os.path.join(folder, "data", task))


def llama_tokenizer():
    """A word-level tokenizer for the tasks' words, with a chat template (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "user": 4, "assistant": 5, ":": 6}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=64, chat_template=CHAT_TEMPLATE)


def _fine_tune(model, tokenizer, texts: list[str], steps: int, seed: int):
    """`steps` Adam steps of next-token prediction on `texts` (a copy of `model`)."""
    import copy

    torch.manual_seed(seed)
    expert = copy.deepcopy(model).train()
    optimizer = torch.optim.Adam(expert.parameters(), lr=3e-3)
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for _ in range(steps):
        optimizer.zero_grad()
        expert(**batch, labels=labels).loss.backward()
        optimizer.step()
    return expert.eval()


def build_tiny_llama(folder: str, seed: int = 0, steps: int = 20) -> dict[str, str]:
    """Write ``base/``, ``experts/<task>/`` (`steps` fine-tuning steps each) and ``data/<task>/`` into
    `folder`; returns the model paths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = llama_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    base = LlamaForCausalLM(config).eval()
    base.save_pretrained(os.path.join(folder, "base"))
    tokenizer.save_pretrained(os.path.join(folder, "base"))
    for index, task in enumerate(TASKS):
        expert = _fine_tune(base, tokenizer, task_texts(task, 48, 100 + index), steps, seed + 1 + index)
        expert.save_pretrained(os.path.join(folder, "experts", task))  # experts without a tokenizer, as is common
    _save_data(folder, chat=True)
    return {"base": os.path.join(folder, "base"), **{t: os.path.join(folder, "experts", t) for t in TASKS}}


def bert_tokenizer():
    """A word-level tokenizer with BERT's special tokens ([CLS] text [SEP]; no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", model_max_length=64)


def build_tiny_bert(folder: str, seed: int = 0) -> dict[str, str]:
    """Write ``base/``, ``experts/<task>/`` and ``data/<task>/`` into `folder`; returns the model paths."""
    from transformers import BertConfig, BertModel

    tokenizer = bert_tokenizer()
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, pad_token_id=0)
    base = BertModel(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # LayerNorms away from (1, 0), as after pre-training
        for module in base.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=generator))
    base.save_pretrained(os.path.join(folder, "base"))
    tokenizer.save_pretrained(os.path.join(folder, "base"))
    for task in TASKS:
        expert = BertModel(config).eval()
        expert.load_state_dict(base.state_dict())
        with torch.no_grad():
            for parameter in expert.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        expert.save_pretrained(os.path.join(folder, "experts", task))
    _save_data(folder, chat=False)
    return {"base": os.path.join(folder, "base"), **{t: os.path.join(folder, "experts", t) for t in TASKS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["llama", "bert"])
    parser.add_argument("folder", help="where base/, experts/ and data/ are written")
    parser.add_argument("--steps", type=int, default=20, help="llama: fine-tuning steps per expert (default 20)")
    args = parser.parse_args()
    if args.kind == "llama":
        build_tiny_llama(args.folder, steps=args.steps)
    else:
        build_tiny_bert(args.folder)
    print(f"Wrote a tiny {args.kind} base, experts {list(TASKS)} and their datasets to {args.folder}/")


if __name__ == "__main__":
    main()

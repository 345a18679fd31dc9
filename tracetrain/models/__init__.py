"""Models: the policy and its tokenizer, as the config names them (used by engines and learners).

    load.py     a config's model section -> the policy and tokenizer (tiny, pretrained, gguf)
    tiny.py     a small Llama and a byte-level tokenizer built offline
    lora.py     LoRA adapters: attach, save, merge
    compute.py  where torch runs the model: one compute thread, the thread count each call asks
"""

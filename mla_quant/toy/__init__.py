"""The embedded toy MLA model: a small DeepSeek-V2 trained on the synthetic tasks of `mla_quant.tasks`.

    from mla_quant.toy.model import load_toy_model, load_toy_tokenizer
    model, tok = load_toy_model(), load_toy_tokenizer()      # the shipped checkpoint in mla_quant/toy/assets/
    python run.py experiment=train_toy                        # the recipe that produced it
"""

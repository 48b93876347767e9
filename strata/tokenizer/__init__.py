"""tokenizer"""

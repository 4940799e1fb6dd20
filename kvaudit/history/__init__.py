"""The history suite: known SGLang and vLLM bugs rediscovered in the releases that shipped them."""

"""Chat data shared by the stages: row formats, dataset loading, the recipe's tokenizer, assistant loss masks."""

"""Training the speculative draft (`k3 train-draft`): k3/model/draft.py is the model,
k3/checkpoint/draft_folder.py its files, k3/serve/speculator.py its use."""

"""Pieces several stages share: the stage command line, tiny local models, model loading."""

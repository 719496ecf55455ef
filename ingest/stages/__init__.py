"""Pipeline stages: plain classes that turn one Arrow batch into another (the actors in ``actors/`` host them)."""

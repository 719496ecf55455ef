"""The verl row contract: text rows (truncate, pad, extra_info), rope positions, chat messages, VerlCollate."""

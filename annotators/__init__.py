"""Stage-1 data makers: rule-based hindsight annotators and the JSONL of their records."""

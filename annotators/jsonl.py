"""annotators/jsonl.py: stage-1 records on disk -- {"prompt", "completion"} JSON lines, so a strong LLM's
annotations can replace the rule-based annotators (train.py --sft-data reads them)."""
import json
import os


def _checked(record, where):
    if not (isinstance(record, dict) and all(isinstance(record.get(key), str) for key in ("prompt", "completion"))):
        raise ValueError(f"{where}: expected a dict with string 'prompt' and 'completion'")
    return record


def write_jsonl(path, records):
    """Write {"prompt", "completion"} records one per line (UTF-8); checks every record before writing."""
    records = [_checked(record, f"record {index}") for index, record in enumerate(records)]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def read_jsonl(path):
    """Read {"prompt", "completion"} records; blank lines are skipped, a bad line raises naming file:line."""
    records = []
    with open(path, "rb") as handle:  # bytes: a line that is not UTF-8 is reported with its number too
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not UTF-8 (byte {error.start + 1} of the line)") from None
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}:{number}: malformed JSON ({error.msg}, column {error.colno})") from None
                records.append(_checked(record, f"{path}:{number}"))
    return records

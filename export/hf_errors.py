"""The error of `reformer import-hf`, apart so the import (hf_import.py) and its parity gate (hf_parity.py) both
raise it without importing each other."""


class HFImportError(Exception):
    """The checkpoint cannot be imported; the message names the file and what is wrong."""

"""The training corpus, book by book: which set folder each file belongs to, its Project Gutenberg ebook id,
its size and its sha256. `reformer data` (train/corpus_fetch.py) writes these files under CORPUS_ROOT, and
`reformer train --corpus data,corpus` (train/corpus.py) and the benchmarks read them there by default.

The digests are those of the copies the shipped model was trained on (Gutenberg files of 1992-2013 releases,
the 17 novels as UTF-8 with Unix line ends). Project Gutenberg revises its files now and then, so a fresh
download may differ: `reformer data` then refuses that file by name rather than train on other text.
No imports beyond the standard library: bench/ scripts read the folder names from here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# where `reformer data` writes and the trainer reads: the clone's git-ignored corpus/ folder, unless
# REFORMER_CORPUS_DIR names another (an installed package has no clone to write into)
CORPUS_ROOT = Path(os.environ.get("REFORMER_CORPUS_DIR") or Path(__file__).resolve().parents[1] / "corpus")
GUTENBERG_URL = "https://www.gutenberg.org/cache/epub/{ebook}/pg{ebook}.txt"
CHAR_RNN = "https://raw.githubusercontent.com/karpathy/char-rnn/master"


@dataclass(frozen=True)
class Book:
    set: str  # the named set (folder under CORPUS_ROOT) it belongs to
    name: str  # the file name under that folder
    ebook: int | None  # its Project Gutenberg ebook number, None for a text from elsewhere
    size: int  # bytes
    sha256: str
    url: str | None = None  # where a book without an ebook number is downloaded from

    def source(self, template: str = GUTENBERG_URL) -> str:
        """The URL to download it from: `template` filled with its ebook number, or its own URL."""
        if self.ebook is not None:
            return template.format(ebook=self.ebook)
        if self.url is None:
            raise ValueError(f"{self.name}: neither an ebook number nor a URL")
        return self.url


# "data": three long books (War and Peace is the long document); "corpus": 18 novels of other authors
BOOKS: tuple[Book, ...] = (
    Book("data", "crime_and_punishment_pg2554.txt", 2554, 1_201_735,
         "3582bcff83e5e24ae5acb2935a191ea5ead66b11fc12fa19b0397834e8296c83"),
    Book("data", "tinyshakespeare.txt", None, 1_115_394,
         "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
         url=f"{CHAR_RNN}/data/tinyshakespeare/input.txt"),
    Book("data", "war_and_peace_pg2600.txt", 2600, 3_359_542,
         "6cbcc5ca5e590fb9ace161a5b93e4ecf280d7118104be0d63b686c004cfa70ae"),
    Book("corpus", "a-tale-of-two-cities_pg98.txt", 98, 788_060,
         "4b66182b552fa8373e61b6c79b80c40fa57b62112d4e87cf9dfea62ef9f19ab3"),
    Book("corpus", "adventures-of-huckleberry-finn_pg76.txt", 76, 603_992,
         "498fd2bbafd69dfe068932add67d0461734c2e21ba6c262b9e2ea130ada8dec0"),
    Book("corpus", "dracula_pg345.txt", 345, 867_219,
         "772a3591a4e088766c5e6580c8277df816bd0e5c72873a3cb22c8c2462fc8512"),
    Book("corpus", "emma_pg158.txt", 158, 910_809,
         "2cd7cdf516952fe3e01b9c73879a4b8c75fcc453e8a00005c031d79279d61216"),
    Book("corpus", "frankenstein_pg84.txt", 84, 442_946,
         "81ed9a92e5356238bf1415351b0df9958440296321645a3e4d1614ee0e656116"),
    Book("corpus", "great-expectations_pg1400.txt", 1400, 1_029_194,
         "e906fcf2ab0c96b7f719bca98b4b22c3fc45e876ea9816c5de748da1996aeb5d"),
    Book("corpus", "jane-eyre_pg1260.txt", 1260, 1_049_267,
         "d21d374abffd2b6caf5072133069df7ae17e0cdef3ddc974db72e40ce477b9ad"),
    Book("corpus", "little-women_pg514.txt", 514, 1_032_446,
         "15595858565cee9fcae50e63735714caa8af88cfa8443879a86b42ebb6d2940c"),
    Book("corpus", "middlemarch_pg145.txt", 145, 1_814_047,
         "eadfd814e955bff4add3466d9adc448fda4667f8ce67df9d8636b58a65f20b43"),
    Book("corpus", "sense-and-sensibility_pg161.txt", 161, 693_116,
         "dd94162bdfefcbe44b0c8cb78f9ccd9cfc598449933e4a0cfb340df45c2fac12"),
    Book("corpus", "the-adventures-of-tom-sawyer_pg74.txt", 74, 418_892,
         "e889fdb30bb8830007d03159330647bb1a19a975af00242fc9784480ccc1eebc"),
    Book("corpus", "the-hound-of-the-baskervilles_pg2852.txt", 2852, 345_659,
         "45096d31582acf1a35e8d430fd9579f2c014e89d4b8df1044b2dd50e8802a4ae"),
    Book("corpus", "the-picture-of-dorian-gray_pg174.txt", 174, 453_198,
         "660a07f9702b39ff2ff67a586aaf6ea00bbe7c900380fc2f0cfecda054b0288a"),
    Book("corpus", "the-scarlet-letter_pg33.txt", 33, 507_004,
         "66ee022a652483a4ae335a49c684066e0797b01d49e2ce9feb86c3e0fe26596d"),
    Book("corpus", "the-time-machine_pg35.txt", 35, 200_909,
         "0ce2978008c256fc3e18e95cbb3eb85a56c7fbf73996de18b7f140cbd01e9891"),
    Book("corpus", "the-war-of-the-worlds_pg36.txt", 36, 360_095,
         "a27341b30b88816091dab4016648e2bcfc9de2f0755e0f4d99edcbee991ad95f"),
    Book("corpus", "treasure-island_pg120.txt", 120, 388_706,
         "9481319d6f6b5dda7fb13fed633498104e5a76a251958e25a0cca3b5b77a059f"),
    Book("corpus", "wuthering-heights_pg768.txt", 768, 669_150,
         "e63881c33991bb2f346632b6d60a53bcd36f10cb68d3cead64c33fcbea35e2d1"),
)
SETS: tuple[str, ...] = ("data", "corpus")


def set_folder(name: str, root: Path | None = None) -> Path:
    """The folder a named set is written to and read from."""
    if name not in SETS:
        raise ValueError(f"unknown corpus set {name!r}: use {', '.join(SETS)}")
    return (root or CORPUS_ROOT) / name


def books_of(sets: tuple[str, ...] | list[str]) -> list[Book]:
    return [b for b in BOOKS if b.set in sets]

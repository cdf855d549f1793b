"""Write ``examples/package_topics.csv``: 400 one-line descriptions of software packages, each
labelled with its topic (``networking``, ``graphics``, ``databases``, ``text``), 100 of each.

The descriptions are written for attnkit (MIT licence, as the rest of the repository; no data
set is copied): each is a kind of package ("Python library", "command-line tool", "daemon", ...)
joined to one of about thirty hand-written phrases of its topic by one of several sentence
shapes, sometimes with a detail that fits any topic ("written in Rust", "development files").
Words such as "server", "files", "library" or "fonts" occur under more than one topic, so a
classifier has to read the phrase, not one word. A fixed seed makes the file the same on every
run (``random.Random``'s choices are stable across Python 3 versions):

    python examples/make_package_topics.py             # writes examples/package_topics.csv
    python examples/make_package_topics.py other.csv   # or another path

    attnkit run text --data examples/package_topics.csv --pretrained minilm \
        --compare align=softmax,sparsemax,entmax15
"""

from __future__ import annotations

import csv
import random
import sys
from pathlib import Path

SEED = 20260
PER_TOPIC = 100

# What a package is: (noun before a "for/to/that" phrase, noun after a noun phrase).
KINDS = [
    ("library", "library"),
    ("Python library", "library for Python"),
    ("Python module", "module for Python"),
    ("command-line tool", "command-line tool"),
    ("small utility", "utility"),
    ("daemon", "daemon"),
    ("Rust crate", "crate for Rust"),
    ("Perl module", "Perl module"),
    ("GTK application", "GTK application"),
    ("Qt frontend", "Qt frontend"),
    ("plugin", "plugin"),
    ("set of scripts", "scripts"),
    ("C++ header-only library", "header-only C++ library"),
    ("Java library", "library for Java"),
    ("Go package", "package for Go"),
    ("shell tool", "shell tool"),
]

# Kinds that name their language take no "written in ..." detail.
LANGUAGES = ("Python", "Rust", "Perl", "C++", "Java", "Go")

# Details that fit any topic (appended to some descriptions).
DETAILS = [
    " (development files)",
    " - documentation",
    ", written in Rust",
    ", written in C",
    " with a small memory footprint",
    " with bindings for Ruby and Lua",
    " (transitional package)",
    ", fast and portable",
    " with a plugin interface",
    " based on GLib",
    " - shared library",
    ", debugging symbols",
]

# Per topic: phrases that follow "for", "to" or "that" (purposes), and noun phrases that name
# what the package handles (things), the i-th thing being what the i-th purpose describes.
TOPICS: dict[str, dict[str, list[str]]] = {
    "networking": {
        "purposes": [
            "for sending HTTP requests with retries and timeouts",
            "to resolve host names asynchronously",
            "to capture packets on a network interface",
            "for tunnelling TCP connections through a SOCKS proxy",
            "to show the bandwidth used by each connection",
            "that sets up WireGuard VPN interfaces",
            "to check which ports are open on a remote host",
            "for serving files over FTP and SFTP",
            "that manages Wi-Fi connections from the panel",
            "for routing IPv6 traffic between subnets",
            "to balance incoming requests across backend servers",
            "that renews TLS certificates for web servers",
            "for writing WebSocket clients and servers",
            "to trace the route packets take to a host",
            "that assigns addresses to machines on the LAN",
            "for talking to devices over SNMP",
            "to forward ports through the home router",
            "that filters traffic with firewall rules",
            "for publishing and subscribing to MQTT topics",
            "to measure latency and packet loss to many hosts",
            "that keeps the system clock in sync with NTP servers",
            "for downloading files over BitTorrent",
            "to inspect and replay captured network sessions",
            "that shares a printer over the local network",
            "for remote login over SSH with key forwarding",
            "to limit the upload rate of each network client",
            "that answers DNS queries for a local zone",
            "for parsing and building IP packets by hand",
            "to discover services announced with mDNS",
            "that proxies and caches web pages for a campus",
        ],
        "things": [
            "HTTP/2 client",
            "asynchronous DNS resolver",
            "packet sniffer",
            "SOCKS5 proxy server",
            "bandwidth monitor",
            "VPN configuration",
            "port scanner",
            "SFTP server",
            "network manager applet",
            "IPv6 router advertisement",
            "reverse proxy and load balancer",
            "ACME certificate client",
            "WebSocket server",
            "traceroute",
            "DHCP server",
            "SNMP agent",
            "UPnP port mapping",
            "packet filter firewall",
            "MQTT broker",
            "network latency prober",
            "NTP client",
            "BitTorrent client",
            "TCP session replay",
            "network printing service",
            "SSH client",
            "traffic shaper",
            "authoritative DNS server",
            "raw socket toolkit",
            "zeroconf service browser",
            "caching web proxy",
        ],
    },
    "graphics": {
        "purposes": [
            "for resizing and cropping PNG and JPEG images",
            "to draw vector shapes with anti-aliasing",
            "that renders 3D scenes with OpenGL",
            "for editing photographs with layers and masks",
            "to convert SVG drawings to bitmaps",
            "that reads and writes TIFF images",
            "for ray tracing with physically based materials",
            "to take screenshots of a window or region",
            "that rasterises TrueType fonts into glyph bitmaps",
            "for colour management with ICC profiles",
            "to view large images with smooth zooming",
            "that compresses textures for game engines",
            "for painting with pressure-sensitive tablets",
            "to apply blur and sharpen filters to pictures",
            "that loads 3D models in the glTF format",
            "for plotting charts as PNG or PDF figures",
            "to record the screen as an animated GIF",
            "that draws the desktop's icons and wallpaper",
            "for decoding WebP and AVIF pictures",
            "to generate thumbnails of images in a folder",
            "that composites windows with shadows and transparency",
            "for sculpting and texturing meshes",
            "to pick colours from anywhere on the screen",
            "that tonemaps HDR photos",
            "for drawing diagrams and flowcharts",
            "to remove red eye and noise from photos",
            "that renders pixel art sprites at any scale",
            "for reading camera RAW files",
            "to stitch several photos into a panorama",
            "that converts between image formats in batch",
        ],
        "things": [
            "image resizing",
            "2D vector drawing",
            "OpenGL scene renderer",
            "raster image editor",
            "SVG rendering",
            "TIFF image",
            "path tracing renderer",
            "screenshot",
            "font rasteriser",
            "colour management",
            "image viewer",
            "texture compression",
            "digital painting",
            "image filter",
            "3D model loader",
            "plotting",
            "screen recorder",
            "desktop icon renderer",
            "WebP image codec",
            "thumbnail generator",
            "window compositor",
            "3D sculpting",
            "colour picker",
            "HDR tonemapping",
            "diagram editor",
            "photo retouching",
            "sprite scaling",
            "camera RAW decoder",
            "panorama stitcher",
            "image format converter",
        ],
    },
    "databases": {
        "purposes": [
            "for connecting to PostgreSQL servers",
            "to run SQL queries against SQLite files",
            "that migrates database schemas between versions",
            "for storing key-value pairs on disk",
            "to back up and restore MySQL databases",
            "that replicates tables to a standby server",
            "for mapping objects to relational tables",
            "to browse and edit tables in a graphical client",
            "that builds indexes to speed up lookups on large tables",
            "for pooling connections to a database server",
            "to export query results as spreadsheets",
            "that caches query results in memory",
            "for storing time series of sensor readings",
            "to query a graph database with Cypher",
            "that checks the consistency of B-tree indexes",
            "for reading and writing Parquet column files",
            "to tune slow queries with execution plans",
            "that runs an embedded document store",
            "for transactions with multi-version concurrency control",
            "to shard a large table across many nodes",
            "that logs every change to a write-ahead log",
            "for talking to MongoDB collections",
            "to load CSV files into database tables",
            "that provides an ODBC driver for applications",
            "for analytical queries over columnar storage",
            "to compare the schemas of two databases",
            "that stores sessions in Redis",
            "for building SQL statements safely from code",
            "to vacuum and compact database files",
            "that exposes a database over a REST interface",
        ],
        "things": [
            "PostgreSQL client",
            "SQLite",
            "schema migration",
            "embedded key-value store",
            "MySQL backup",
            "database replication",
            "object-relational mapper",
            "graphical SQL client",
            "database indexing",
            "connection pooler",
            "query result exporter",
            "query cache",
            "time series database",
            "graph database driver",
            "B-tree index checker",
            "Parquet file",
            "query planner",
            "embedded document database",
            "MVCC transaction engine",
            "database sharding",
            "write-ahead logging",
            "MongoDB driver",
            "SQL bulk loader",
            "ODBC driver",
            "columnar analytics engine",
            "schema diff",
            "Redis session store",
            "SQL query builder",
            "database compaction",
            "SQL REST gateway",
        ],
    },
    "text": {
        "purposes": [
            "for searching files with regular expressions",
            "to convert Markdown documents to HTML",
            "that checks the spelling of English texts",
            "for splitting sentences into words and tokens",
            "to detect the character encoding of a file",
            "that hyphenates words for typesetting",
            "for comparing two texts line by line",
            "to translate strings in program messages",
            "that formats paragraphs to a fixed width",
            "for stemming and lemmatising English words",
            "to count words, lines and characters",
            "that converts text between UTF-8 and Latin-1",
            "for parsing and pretty-printing JSON documents",
            "to extract plain text from PDF documents",
            "that highlights the syntax of source code",
            "for typesetting documents with LaTeX",
            "to find and replace patterns in many files",
            "that normalises Unicode strings",
            "for fuzzy matching of misspelled names",
            "to sort the lines of large text files",
            "that transliterates Cyrillic into Latin letters",
            "for editing plain text with vi key bindings",
            "to generate man pages from reStructuredText",
            "that detects the language of a paragraph",
            "for templating text with placeholders",
            "to check the grammar and style of prose",
            "that wraps long lines in e-mail messages",
            "for reading and writing YAML files",
            "to build a concordance of words in a book",
            "that strips markup from HTML pages",
        ],
        "things": [
            "regular expression search",
            "Markdown to HTML converter",
            "spell checker",
            "word tokenizer",
            "character encoding detector",
            "hyphenation patterns",
            "text diff",
            "message catalog",
            "paragraph formatter",
            "English stemmer",
            "word counting",
            "UTF-8 conversion",
            "JSON pretty-printer",
            "PDF text extraction",
            "syntax highlighting",
            "LaTeX typesetting",
            "search and replace",
            "Unicode normalisation",
            "fuzzy string matching",
            "line sorting",
            "transliteration",
            "modal text editor",
            "man page generator",
            "language identification",
            "text templating",
            "grammar checker",
            "line wrapping",
            "YAML parser",
            "concordance builder",
            "HTML to text converter",
        ],
    },
}


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def describe(rng: random.Random, topic: dict[str, list[str]]) -> str:
    """One description of a package of ``topic``: a kind of package and one of the topic's
    purposes (or the thing it names), in one of four sentence shapes."""
    before, after = rng.choice(KINDS)
    i = rng.randrange(len(topic["purposes"]))
    purpose, thing = topic["purposes"][i], topic["things"][i]
    shape = rng.randrange(4)
    if shape == 0:  # "Python library for sending HTTP requests ..."
        text = f"{_capital(before)} {purpose}"
    elif shape == 1:  # "Packet sniffer library for Python"
        text = f"{_capital(thing)} {after}"
    elif shape == 2:  # "Packet sniffer - command-line tool to capture packets ..."
        text = f"{_capital(thing)} - {before} {purpose}"
    else:  # "A daemon to resolve host names asynchronously."
        article = "An" if before[0].lower() in "aeiou" else "A"
        text = f"{article} {before} {purpose}."
    if rng.random() < 0.3 and not text.endswith("."):
        detail = rng.choice(DETAILS)
        if "written in" not in detail or not any(w in before for w in LANGUAGES):
            text += detail
    return text


def rows(seed: int = SEED, per_topic: int = PER_TOPIC) -> list[tuple[str, str]]:
    """``per_topic`` distinct descriptions of each topic, as (text, label), in a shuffled order."""
    rng = random.Random(seed)
    out = []
    for label, topic in TOPICS.items():
        seen: set[str] = set()
        while len(seen) < per_topic:
            text = describe(rng, topic)
            if text not in seen:
                seen.add(text)
                out.append((text, label))
    rng.shuffle(out)
    return out


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else Path(__file__).with_name("package_topics.csv")
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["text", "label"])
        writer.writerows(rows())
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""What the tests of test_house.py share (tests/*/test_house.py: the tiers, and other test modules)."""


def strip_marked(text: str, tag: str = "CRITIC") -> str:
    """The script without its `# CRITIC {` ... `# CRITIC }` blocks and its lines ending in `# CRITIC`."""
    out, depth = [], 0
    for line in text.splitlines(keepends=True):
        s = line.strip()
        if s.startswith(f"# {tag} {{"):
            depth += 1
        elif s.startswith(f"# {tag} }}"):
            depth -= 1
        elif depth == 0 and not s.endswith(f"# {tag}"):
            out.append(line)
    assert depth == 0, f"unbalanced # {tag} blocks"
    return "".join(out)

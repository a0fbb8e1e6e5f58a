"""CLI entries for serving: `osd serve` and `osd bench serve` (filled in by the serving work)."""


def register(sub, bench) -> None:
    """Add the serving subcommands to the `osd` parser (sub) and the `osd bench` parser (bench)."""

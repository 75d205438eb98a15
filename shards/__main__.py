from shards.cli import app

app(prog_name="python -m shards")

from tformer.cli.main import entry

entry()

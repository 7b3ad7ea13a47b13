from sandboxfs.cli.main import entry

entry()

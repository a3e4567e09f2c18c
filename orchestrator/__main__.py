from orchestrator.app import cli

cli()

from terra_cli.cli import main

main()

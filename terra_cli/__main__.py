from terra_cli.cli import main

# Guarded: data-parallel workers are spawned processes, which import this module again.
if __name__ == "__main__":
    main()

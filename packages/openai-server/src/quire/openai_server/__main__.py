from quire.openai_server.cli import main

main()

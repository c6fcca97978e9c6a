from agentgym.cli.main import main

main()

"""`mesh mcp`: one MCP endpoint offering every tool of the fleet."""

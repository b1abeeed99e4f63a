package main

import "github.com/spf13/cobra"

func serveCmd(g *globals) *cobra.Command {
	return &cobra.Command{Use: "serve"}
}

package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/gorm-outbox/outbox/outboxui"
)

func serveCmd(g *globals) *cobra.Command {
	var addr, token string
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve the web dashboard (package outboxui) until interrupted",
		Long: `serve runs the dashboard of the table at --addr. It needs a token of at
least 16 bytes, from --token or OUTBOX_UI_TOKEN: browsers sign in with it
once (a cookie keeps the session), scripts send it as a bearer token.`,
		Example: `  OUTBOX_UI_TOKEN=$(openssl rand -hex 16) outboxctl serve --db postgres://localhost/app --addr 127.0.0.1:8080`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(token) < 16 {
				return errors.New("serve: --token (or OUTBOX_UI_TOKEN) must be at least 16 bytes: the dashboard can requeue messages")
			}
			d, done, err := g.dispatcher(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			ln, err := net.Listen("tcp", addr)
			if err != nil {
				return fmt.Errorf("serve: %w", err)
			}
			srv := &http.Server{Handler: outboxui.Handler(d, outboxui.WithToken(token)), ReadHeaderTimeout: 10 * time.Second}
			fmt.Fprintf(g.stdout, "serving the dashboard of %s on http://%s/\n", g.table, ln.Addr())
			served := make(chan error, 1)
			go func() { served <- srv.Serve(ln) }()
			select {
			case err := <-served:
				return fmt.Errorf("serve: %w", err)
			case <-cmd.Context().Done():
			}
			shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			return srv.Shutdown(shut)
		},
	}
	cmd.Flags().StringVar(&addr, "addr", "127.0.0.1:8080", "address to listen on")
	cmd.Flags().StringVar(&token, "token", os.Getenv("OUTBOX_UI_TOKEN"), "the dashboard's token (default $OUTBOX_UI_TOKEN)")
	return cmd
}

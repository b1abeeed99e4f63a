package outbox

import (
	"context"
	"errors"
	"fmt"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// checkConn fails when db's connections cannot serve the plugin and the
// dispatcher (the dialect's CheckConn: on MySQL, a DSN without
// parseTime=true), with an error wrapping ErrInvalidOption; a server that
// does not answer within settingsCheckTimeout fails it with the server's
// error.
func checkConn(db *gorm.DB, dl dialect.Dialect) error {
	ctx := db.Statement.Context
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithTimeout(ctx, settingsCheckTimeout)
	defer cancel()
	err := dl.CheckConn(ctx, db.Statement.ConnPool)
	switch {
	case errors.Is(err, dialect.ErrUnfitConn):
		return fmt.Errorf("%w: %w", ErrInvalidOption, err)
	case err != nil:
		return fmt.Errorf("outbox: %w", err)
	}
	return nil
}

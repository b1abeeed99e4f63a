package outbox

import (
	"context"
	"fmt"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// checkParseTime fails on MySQL and MariaDB unless the connection reads
// DATETIME columns as time.Time, which go-sql-driver/mysql does only with
// parseTime=true in the DSN. Without it the driver returns text: the
// plugin, which reads back the rows of emitting models, cannot scan their
// time fields, so their writes fail; and the dispatcher reads its own
// timestamps as UTC whatever the DSN's loc, off by loc's offset. It asks
// the server for one DATETIME and looks at what the driver returns, so
// that this package imports no driver; a server that does not answer
// within settingsCheckTimeout fails it with the server's error.
func checkParseTime(db *gorm.DB, dl dialect.Dialect) error {
	if dl.Name() != "mysql" {
		return nil
	}
	ctx := db.Statement.Context
	if ctx == nil {
		ctx = context.Background()
	}
	ctx, cancel := context.WithTimeout(ctx, settingsCheckTimeout)
	defer cancel()
	var v any
	err := db.Statement.ConnPool.QueryRowContext(ctx, `SELECT CAST('2000-01-01 00:00:00' AS DATETIME)`).Scan(&v)
	if err != nil {
		return fmt.Errorf("outbox: checking that the MySQL DSN has parseTime=true: %w", err)
	}
	if _, ok := v.(time.Time); !ok {
		return fmt.Errorf("%w: the MySQL DSN needs parseTime=true: without it the driver reads DATETIME columns as text, which the plugin cannot scan into a model's time fields and the dispatcher reads in UTC whatever loc says", ErrInvalidOption)
	}
	return nil
}

package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// WithPluginLogger sets the logger of the plugin (default slog.Default()
// when [Plugin] is called). The plugin logs only at db.Use: one warning
// for each database setting that the documentation says matters and that
// the database runs without (see [OutboxPlugin.Initialize]).
func WithPluginLogger(l *slog.Logger) Option {
	return func(p *OutboxPlugin) error {
		if l == nil {
			return fmt.Errorf("%w: WithPluginLogger: nil logger", ErrInvalidOption)
		}
		p.log = l
		return nil
	}
}

// settingsCheckTimeout bounds the queries of warnSettings.
const settingsCheckTimeout = 5 * time.Second

// warnSettings logs one warning for each setting of db's database that the
// documentation says matters and that the database runs without, saying
// what to set and why (the dialect's Settings: on SQLite, a file's WAL
// journal mode and busy timeout; on PostgreSQL, autovacuum). It never
// fails: a setting whose query fails is logged at debug level and left
// out.
func warnSettings(ctx context.Context, db *gorm.DB, d dialect.Dialect, t dialect.Tables, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(ctx, settingsCheckTimeout)
	defer cancel()
	for _, w := range d.Settings(ctx, db.Statement.ConnPool, t) {
		if w.Err != nil {
			log.DebugContext(ctx, "outbox: database setting not checked", "check", w.Check, "error", w.Err)
			continue
		}
		log.WarnContext(ctx, w.Message, w.Attrs...)
	}
}

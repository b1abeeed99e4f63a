package outbox_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	mysqldriver "github.com/go-sql-driver/mysql"
	"gorm.io/driver/mysql"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// TestMySQLWithoutParseTimeIsRefusedAtUseAndNewDispatcher: without
// parseTime=true the driver reads DATETIME columns as text, so the
// plugin's reads of emitting models with time fields fail and the
// dispatcher reads its times in UTC whatever loc says. db.Use and
// NewDispatcher refuse such a DSN with an error that names parseTime=true;
// the same database with it is accepted.
func TestMySQLWithoutParseTimeIsRefusedAtUseAndNewDispatcher(t *testing.T) {
	withParseTime, info := outboxtest.OpenMySQL(t, nil)
	mustNil(t, outbox.AutoMigrate(withParseTime))
	conf, err := mysqldriver.ParseDSN(info.DSN)
	mustNil(t, err)
	conf.ParseTime = false
	without, err := gorm.Open(mysql.Open(conf.FormatDSN()), &gorm.Config{})
	mustNil(t, err)
	t.Cleanup(func() {
		if sqlDB, err := without.DB(); err == nil {
			sqlDB.Close()
		}
	})
	nop := outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil })

	for _, c := range []struct {
		name string
		init func(db *gorm.DB) error
	}{
		{"Use", func(db *gorm.DB) error { return db.Use(outbox.Plugin()) }},
		{"NewDispatcher", func(db *gorm.DB) error { _, err := outbox.NewDispatcher(db, nop); return err }},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.init(without)
			if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), "parseTime=true") {
				t.Fatalf("without parseTime: %v, want ErrInvalidOption naming parseTime=true", err)
			}
			if err := c.init(withParseTime.Session(&gorm.Session{})); err != nil {
				t.Fatalf("with parseTime: %v", err)
			}
		})
	}
}

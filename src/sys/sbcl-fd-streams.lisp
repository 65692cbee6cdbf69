;;;; The fd-stream a connection is read and written through, by SBCL's
;;;; internals (sb-impl's fd-stream structure and its buffer pool).
;;;;
;;;; SB-SYS:MAKE-FD-STREAM parses its element type (SUBTYPEP, several times)
;;;; and asks fstat(2) the descriptor's type at every call: 10% of ours'
;;;; user time a connection that carries one request (bench/profiles/
;;;; 2026-11-29-new-connection-costs.txt).  Every connection's stream is the
;;;; same but for its descriptor, its timeout, its buffers and its array of
;;;; unread characters, so the first is made by MAKE-FD-STREAM and each
;;;; after copies an unused copy of it with those of its own -- the rest are
;;;; its routines, its type and constants.  The test
;;;; connection-fd-stream.copied-as-make-fd-stream-makes-it compares every
;;;; slot of a copy with MAKE-FD-STREAM's stream on the same descriptor, so
;;;; that an SBCL whose fd-stream gains a slot of per-stream state fails it.
;;;; A connection's stream is closed as CLOSE closes it, less what only
;;;; streams with a finalizer need (CLOSE-CONNECTION-FD-STREAM); the test
;;;; connection-fd-stream.closed-as-close-closes-it compares every slot.

(in-package #:hunchentoot-recycling-taskmaster)

(defun fd-stream-descriptor (stream)
  "The descriptor of STREAM, an SBCL fd-stream (a socket's, say)."
  (sb-sys:fd-stream-fd stream))

(defun fd-stream-class ()
  "The class of the streams MAKE-CONNECTION-FD-STREAM makes."
  (find-class 'sb-sys:fd-stream))

(defun make-fd-stream-for-connection (fd timeout)
  "A binary bidirectional stream on the connection FD made by SBCL's
MAKE-FD-STREAM, as MAKE-CONNECTION-FD-STREAM's are."
  (sb-sys:make-fd-stream fd :input t :output t :element-type '(unsigned-byte 8)
                            :buffering :full :timeout timeout :auto-close nil
                            :name "hunchentoot-recycling-taskmaster connection"))

(sb-ext:define-load-time-global **connection-fd-stream-prototype** nil
  "An unused copy of the first connection's fd-stream, with no descriptor
and no buffers, which MAKE-CONNECTION-FD-STREAM copies; NIL before the
first connection.  Two threads making the first at once each store one,
alike.")

(defun connection-fd-stream-prototype (stream)
  "An unused copy of STREAM, new from MAKE-FD-STREAM-FOR-CONNECTION: the
same routines and constants, no descriptor, no buffers."
  (let ((prototype (copy-structure stream)))
    (setf (sb-impl::fd-stream-fd prototype) -1
          (sb-impl::fd-stream-ibuf prototype) nil
          (sb-impl::fd-stream-obuf prototype) nil)
    prototype))

(defun make-connection-fd-stream (fd timeout)
  "A binary bidirectional stream on the connection FD whose reads and writes
give up after TIMEOUT seconds (NIL: never), as Hunchentoot sets them, made
as MAKE-FD-STREAM-FOR-CONNECTION makes it.  No finalizer: the readiness set
closes every connection itself."
  (let ((prototype **connection-fd-stream-prototype**))
    (if (null prototype)
        (let ((stream (make-fd-stream-for-connection fd timeout)))
          (setf **connection-fd-stream-prototype** (connection-fd-stream-prototype stream))
          stream)
        (let ((stream (copy-structure prototype)))
          (setf (sb-impl::fd-stream-fd stream) fd
                (sb-impl::fd-stream-timeout stream) (and timeout (coerce timeout 'single-float))
                (sb-impl::fd-stream-instead stream) (make-array 0 :element-type 'character
                                                                  :adjustable t :fill-pointer t)
                (sb-impl::fd-stream-ibuf stream) (sb-impl::get-buffer)
                (sb-impl::fd-stream-obuf stream) (sb-impl::get-buffer))
          stream))))

(defun close-connection-fd-stream (stream)
  "Close STREAM, made by MAKE-CONNECTION-FD-STREAM, as CLOSE with :ABORT T
closes an fd-stream -- its input dropped, its descriptor closed, its
routines a closed stream's, its buffers back in SBCL's pool -- but without
CLOSE's generic dispatch and its call to CANCEL-FINALIZATION, which
searches SBCL's finalizers under a lock of the whole process for the one
these streams never have: CLOSE took 5% of ours' user time a connection
that carries one request, this 3% (bench/profiles/
2026-11-29-reply-objects-and-closing.txt).  A stream left waiting to write
through serve-event (a handler, queued output) is closed by CLOSE itself."
  (cond ((not (open-stream-p stream)))
        ((or (sb-impl::fd-stream-handler stream) (sb-impl::fd-stream-output-queue stream))
         (close stream :abort t))
        (t
         (setf (sb-impl::ansi-stream-in-index stream) sb-impl::+ansi-stream-in-buffer-length+
               (sb-impl::ansi-stream-cin-buffer stream) nil
               (sb-impl::ansi-stream-in-buffer stream) nil)
         (sb-sys:without-interrupts
           (let ((fd (sb-impl::fd-stream-fd stream)))
             (when (and (/= fd -1) (compare-and-swap (sb-impl::fd-stream-fd stream) fd -1))
               (sb-unix:unix-close fd)))
           (sb-impl::set-closed-flame stream))
         (release-fd-stream-buffers stream)))
  t)

(defun release-fd-stream-buffers (stream)
  "Give STREAM's buffers back to SBCL's pool, as CLOSE does: its input and
output buffers and those of its output queue.  SBCL's own function for it
went in 2.6.3 (folded into RELEASE-FD-STREAM-RESOURCES, which closes the
descriptor too and cancels a finalizer): its steps, which 2.2.9 and 2.6
share, are taken here."
  (let ((ibuf (shiftf (sb-impl::fd-stream-ibuf stream) nil))
        (obuf (shiftf (sb-impl::fd-stream-obuf stream) nil)))
    (when ibuf (sb-impl::release-buffer ibuf))
    (when obuf (sb-impl::release-buffer obuf))
    (dolist (buffer (shiftf (sb-impl::fd-stream-output-queue stream) nil))
      (when (sb-impl::buffer-p buffer)
        (sb-impl::release-buffer buffer)))))

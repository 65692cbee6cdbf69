;;;; What has arrived on a connection, read without waiting into a worker's
;;;; buffer: from the socket, or from the TLS stream over it.

(in-package #:hunchentoot-recycling-taskmaster)

(defun read-arrived-octets (stream buffer start end)
  "Read into BUFFER from START below END the octets STREAM can give without
waiting; the position after the last one."
  (loop with position = start
        while (and (< position end) (listen stream))
        do (setf (aref buffer position) (read-byte stream))
           (incf position)
        finally (return position)))

(defun receive-from-stream (stream fd buffer start end)
  "Take what STREAM (an SSL stream) has decrypted, without waiting, into BUFFER:
cl+ssl's own stream in one SSL_read (RECEIVE-TLS-OCTETS), another (a
mixin's around it) through LISTEN, which reads ahead into the stream's own
buffer, so bytes decrypted earlier are found there, not on the socket."
  (when (tls-stream-p stream)
    (return-from receive-from-stream (receive-tls-octets stream buffer start end)))
  (handler-case
      (let ((position (read-arrived-octets stream buffer start end)))
        (cond ((> position start) (- position start))
              ((end-of-file-p fd) 0)
              (t :would-block)))
    (error () :error)))

(defun receive-bytes (connection buffer start end)
  "Bytes that have arrived on CONNECTION, into BUFFER from START below END:
their count, 0 at end of file, :WOULD-BLOCK or :ERROR."
  (if (plain-connection-p connection)
      (let ((count (receive-available (connection-fd connection) buffer start end)))
        ;; A read short of END took everything there was: what comes later
        ;; is a new edge.
        (setf (connection-unread-p connection) (and (integerp count) (= count (- end start))))
        count)
      (receive-from-stream (connection-stream connection) (connection-fd connection) buffer start end)))

(defun keep-pending-bytes (connection buffer end budget)
  "Keep the END octets at the start of BUFFER (the start of a head, or
requests sent ahead) with CONNECTION while it waits, counted against the
memory BUDGET; nothing when END is 0."
  (when (plusp end)
    (charge-memory budget end)
    (setf (connection-pending connection) (subseq buffer 0 end))))

(defun drop-pending-bytes (connection budget)
  "Forget CONNECTION's pending octets, if any, giving them back to BUDGET."
  (let ((pending (shiftf (connection-pending connection) nil)))
    (when pending
      (release-memory budget (length pending)))))

(defun take-pending-bytes (connection buffer budget)
  "Move CONNECTION's pending octets to the start of BUFFER, giving them
back to BUDGET; their count."
  (let ((pending (shiftf (connection-pending connection) nil)))
    (if pending
        (progn (release-memory budget (length pending))
               (replace buffer pending)
               (length pending))
        0)))

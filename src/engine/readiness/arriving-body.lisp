;;;; Request bodies that arrive after their head.  A request whose body
;;;; (Content-Length or chunked) has not all come with its head is not
;;;; dispatched: the engine reads the body as it reads heads, without
;;;; waiting, parking the connection between reads, into memory up to the
;;;; acceptor's BODY-BUFFER-BYTES and beyond that into a temporary file.
;;;; Memory follows the octets that arrived, never the length a client
;;;; declares.  A chunked body is kept as it came, framing and all, its end
;;;; found by CHUNK-FRAMING (http/chunk-framing.lisp), which refuses broken
;;;; framing and chunks beyond the limit before any handler runs.  Once the
;;;; body is whole the request is answered, its handler reading the body
;;;; from memory or the file (through the chunked decoder for a chunked
;;;; body); the file is removed after the request, or when the connection
;;;; ends first.  A body that stalls for the read timeout is answered 408.
;;;; Only the connection's holder touches its ARRIVING-BODY
;;;; (connection.lisp, Ownership).

(in-package #:hunchentoot-recycling-taskmaster)

(defstruct (arriving-body (:constructor %make-arriving-body (head length framing budget)))
  "A request whose head has arrived and whose body is arriving."
  ;; The request's REQUEST-HEAD.
  (head nil :read-only t)
  ;; The octets the body has, from its Content-Length; NIL for a chunked
  ;; body.
  (length nil :type (or null (integer 0)) :read-only t)
  ;; The CHUNK-FRAMING that finds a chunked body's end; NIL for a
  ;; Content-Length body.
  (framing nil :read-only t)
  ;; Where the first octets are kept, grown as they arrive, and the
  ;; MEMORY-BUDGET its size is taken from.
  (octets (make-array 0 :element-type '(unsigned-byte 8)) :type octets)
  (budget nil :read-only t)
  ;; How many octets have arrived.
  (fill 0 :type (integer 0))
  ;; The temporary file the body went on in once it outgrew memory, and the
  ;; stream open on it (for output while the body arrives, for input while
  ;; the handler reads it); NIL before.
  (path nil)
  (file nil))

(defmethod print-object ((body arriving-body) stream)
  ;; Never the octets: they are a client's.
  (print-unreadable-object (body stream :type t :identity t)
    (format stream "~D of ~:[a chunked body's~;~:*~D~] octets~:[~; in a file~]"
            (arriving-body-fill body) (arriving-body-length body) (arriving-body-path body))))

(defun body-room (length wanted)
  "WANTED octets, but no more than LENGTH, a body's length (NIL: unknown)."
  (if length (min length wanted) wanted))

(defun start-arriving-body (set connection head length framing buffer start end)
  "Make the body of HEAD, LENGTH octets (NIL for a chunked body, whose end
FRAMING finds) of which the first lie in BUFFER from START below END,
CONNECTION's ARRIVING-BODY."
  (let ((body (%make-arriving-body head length framing (readiness-set-memory-budget set))))
    (setf (connection-arriving-body connection) body)
    (atomic-increment (readiness-set-arriving-body-count set))
    (add-body-octets body buffer start end most-positive-fixnum)
    body))

(defvar *body-random-state* (make-random-state t)
  "Names temporary body files, so that they cannot be guessed.")

(defun temporary-body-path ()
  (merge-pathnames (format nil "hrt-body-~36R" (random (expt 2 64) *body-random-state*))
                   hunchentoot:*tmp-directory*))

(defun grow-body-octets (body wanted)
  "Give BODY room in memory for WANTED octets in all, taken from its memory
budget first.  False, and nothing changed, when the budget has no room."
  (let* ((octets (arriving-body-octets body))
         (size (body-room (arriving-body-length body) (max wanted (* 2 (length octets)) 4096))))
    (when (reserve-memory (arriving-body-budget body) (- size (length octets)))
      (setf (arriving-body-octets body)
            (replace (make-array size :element-type '(unsigned-byte 8)) octets :end2 (arriving-body-fill body)))
      t)))

(defun add-body-octets (body buffer start end memory-limit)
  "Add the octets of BUFFER from START below END to BODY: in memory while it
stays within MEMORY-LIMIT octets and the memory budget has room, else in
its temporary file."
  (let ((count (- end start))
        (fill (arriving-body-fill body)))
    (if (and (null (arriving-body-file body))
             (<= (+ fill count) memory-limit)
             (or (<= (+ fill count) (length (arriving-body-octets body)))
                 (grow-body-octets body (+ fill count))))
        (replace (arriving-body-octets body) buffer :start1 fill :start2 start :end2 end)
        (write-body-file-octets body buffer start end))
    (incf (arriving-body-fill body) count)))

(defun forget-body-octets (body)
  "Let go of the octets BODY keeps in memory, giving them back to its budget."
  (release-memory (arriving-body-budget body) (length (arriving-body-octets body)))
  (setf (arriving-body-octets body) (make-array 0 :element-type '(unsigned-byte 8))))

(defun write-body-file-octets (body buffer start end)
  "Write the octets of BUFFER from START below END to BODY's temporary file,
made at the first call from the octets BODY had in memory.  Signals
REQUEST-BODY-NOT-STORED when the file cannot be made or written."
  (let ((path (or (arriving-body-path body)
                  (setf (arriving-body-path body) (temporary-body-path)))))
    (handler-case
        (progn
          (unless (arriving-body-file body)
            (ensure-directories-exist path)
            (setf (arriving-body-file body) (open path :direction :output :element-type '(unsigned-byte 8)
                                                       :if-exists :supersede))
            (write-sequence (arriving-body-octets body) (arriving-body-file body)
                            :end (arriving-body-fill body))
            (forget-body-octets body))
          (write-sequence buffer (arriving-body-file body) :start start :end end))
      ((or file-error stream-error) (condition)
        (error 'request-body-not-stored :path path :cause condition)))))

(defun receive-body-octets (connection body buffer memory-limit)
  "Read what has arrived of BODY on CONNECTION through BUFFER: never past the
end of a Content-Length body; past a chunked body's end, since only its
framing tells where that is.  Returns :WHOLE and, for a chunked body, a
vector of the octets read after it (the next request's); :WOULD-BLOCK (some
may have come); :CLOSED; or :REFUSE and the status a chunked body is
refused with."
  (let ((framing (arriving-body-framing body)))
    (loop
      (let ((wanted (if framing
                        (length buffer)
                        (min (- (arriving-body-length body) (arriving-body-fill body)) (length buffer)))))
        (when (zerop wanted)
          (return :whole))
        (let ((count (receive-bytes connection buffer 0 wanted)))
          (cond ((eq count :would-block) (return :would-block))
                ((or (eq count :error) (zerop count)) (return :closed))
                ((null framing) (add-body-octets body buffer 0 count memory-limit))
                (t (multiple-value-bind (outcome detail) (scan-chunk-framing framing buffer 0 count)
                     (ecase outcome
                       (:incomplete (add-body-octets body buffer 0 count memory-limit))
                       (:refuse (return (values :refuse detail)))
                       (:complete
                        (add-body-octets body buffer 0 detail memory-limit)
                        (return (values :whole (subseq buffer detail count)))))))))))))

(defun arrived-body-stream (body)
  "A binary input stream of BODY, which has arrived whole."
  (let ((file (arriving-body-file body)))
    (if file
        (progn (close file)
               (setf (arriving-body-file body) (open (arriving-body-path body) :element-type '(unsigned-byte 8))))
        (make-octets-input-stream (arriving-body-octets body) :end (arriving-body-fill body)))))

(defun receive-arriving-body (connection buffer memory-limit)
  "Read what has arrived of CONNECTION's ARRIVING-BODY through BUFFER,
keeping up to MEMORY-LIMIT octets of it in memory (RECEIVE-BODY-OCTETS).
Once it is whole: :WHOLE, the octets read after it (the next request's,
empty but for a chunked body), its REQUEST-HEAD, a binary input stream of
it, and whether it is chunked.  Else :WOULD-BLOCK, :CLOSED, or :REFUSE and
the status a chunked body is refused with."
  (let ((body (connection-arriving-body connection)))
    (multiple-value-bind (state detail) (receive-body-octets connection body buffer memory-limit)
      (if (eq state :whole)
          (values :whole (or detail #()) (arriving-body-head body) (arrived-body-stream body)
                  (and (arriving-body-framing body) t))
          (values state detail)))))

(defun discard-arriving-body (set connection)
  "Forget CONNECTION's ARRIVING-BODY, removing its temporary file."
  (let ((body (shiftf (connection-arriving-body connection) nil)))
    (forget-body-octets body)
    (when (arriving-body-file body)
      (ignore-errors (close (arriving-body-file body) :abort t)))
    (when (arriving-body-path body)
      (ignore-errors (delete-file (arriving-body-path body))))
    (atomic-decrement (readiness-set-arriving-body-count set))))

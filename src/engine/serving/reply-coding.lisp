;;;; Replies coded as the client accepts (gzip, Brotli, Zstandard), with
;;;; nginx's rules: only an acceptor given :COMPRESSION codes, only 200, 403
;;;; and 404 replies, of its COMPRESSION-TYPES, at least its
;;;; COMPRESSION-MIN-BYTES long, that carry no Content-Encoding of their
;;;; own; such a reply gets Vary: Accept-Encoding whether it is coded or
;;;; not, and a coded one an entity tag of its own.  Each worker keeps its
;;;; compressors (a gzip stream, a Zstandard context) from its first coded
;;;; reply to its end.  Coded here: the replies the engine writes as
;;;; octets (reply.lisp), the static files serve-static-file reads
;;;; (static-files.lisp), and with gzip a reply streamed through
;;;; SEND-HEADERS, chunk by chunk as the handler writes it, everything
;;;; written sent at each FORCE-OUTPUT.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +coding-scratch-bytes+ (* 1024 1024)
  "The largest buffer a worker keeps to code replies into; a reply whose
coded bound is larger gets a buffer of its own.")

(defstruct (reply-coders (:constructor make-reply-coders ()))
  "A worker's compressors, and its inflater of websocket messages, each
made when first needed."
  ;; A deflate stream writing gzip, and its level.
  (gzip nil)
  (gzip-level 0 :type fixnum)
  ;; A Zstandard compression context.
  (zstd nil)
  ;; A raw inflate stream, for websocket messages (permessage-deflate).
  (inflate nil)
  ;; Where replies are coded before their octets are copied out.
  (scratch (make-array 0 :element-type '(unsigned-byte 8)) :type (simple-array (unsigned-byte 8) (*))))

(defun free-reply-coders (coders)
  "Free the foreign compressors of CODERS (NIL for none)."
  (when coders
    (let ((gzip (shiftf (reply-coders-gzip coders) nil))
          (zstd (shiftf (reply-coders-zstd coders) nil))
          (inflate (shiftf (reply-coders-inflate coders) nil)))
      (when gzip (free-gzip-stream gzip))
      (when zstd (free-zstd-context zstd))
      (when inflate (free-inflate-stream inflate)))))

(defun worker-coders ()
  (or (serving-coders *serving*)
      (setf (serving-coders *serving*) (make-reply-coders))))

(defun worker-inflate-stream ()
  "This worker's raw inflate stream."
  (let ((coders (worker-coders)))
    (or (reply-coders-inflate coders)
        (setf (reply-coders-inflate coders) (make-inflate-stream)))))

(defun gzip-stream-of (coders level)
  (unless (and (reply-coders-gzip coders) (= level (reply-coders-gzip-level coders)))
    (when (reply-coders-gzip coders)
      (free-gzip-stream (reply-coders-gzip coders)))
    (setf (reply-coders-gzip coders) (make-gzip-stream level)
          (reply-coders-gzip-level coders) level))
  (reply-coders-gzip coders))

(defun coded-octets (coding level octets)
  "OCTETS coded with CODING (:GZIP, :BR or :ZSTD) at LEVEL by this worker's
compressors, as a new vector."
  (declare (type (simple-array (unsigned-byte 8) (*)) octets))
  (let* ((coders (worker-coders))
         (gzip (and (eq coding :gzip) (gzip-stream-of coders level)))
         (zstd (and (eq coding :zstd)
                    (or (reply-coders-zstd coders) (setf (reply-coders-zstd coders) (make-zstd-context)))))
         (bound (ecase coding
                  (:gzip (gzip-bound gzip (length octets)))
                  (:zstd (zstd-bound (length octets)))
                  (:br (brotli-bound (length octets)))))
         (output (cond ((> bound +coding-scratch-bytes+)
                        (make-array bound :element-type '(unsigned-byte 8)))
                       ((< (length (reply-coders-scratch coders)) bound)
                        (setf (reply-coders-scratch coders)
                              (make-array (min +coding-scratch-bytes+ (max bound 65536))
                                          :element-type '(unsigned-byte 8))))
                       (t (reply-coders-scratch coders))))
         (count (ecase coding
                  (:gzip (gzip-octets gzip octets output))
                  (:zstd (zstd-octets zstd level octets output))
                  (:br (brotli-octets level octets output)))))
    (subseq output 0 count)))

(defun codable-reply-p (acceptor return-code content-type length)
  "True when a reply of ACCEPTOR with RETURN-CODE, CONTENT-TYPE and a body of
LENGTH octets would be coded for a client that accepts a coding."
  (and (reply-compression acceptor)
       (member return-code '(200 403 404))
       (>= length (acceptor-compression-min-bytes acceptor))
       (null (hunchentoot:header-out :content-encoding))
       (codable-type-p content-type (acceptor-compression-types acceptor))))

(defun add-vary-accept-encoding ()
  "Name Accept-Encoding in the reply's Vary header."
  (let ((vary (hunchentoot:header-out :vary)))
    (cond ((null vary) (setf (hunchentoot:header-out :vary) "Accept-Encoding"))
          ((or (search "accept-encoding" vary :test #'char-equal) (string= "*" (string-trim " " vary))))
          (t (setf (hunchentoot:header-out :vary) (concatenate 'string vary ", Accept-Encoding"))))))

(defun reply-coding (request)
  "The (CODING . LEVEL) of the acceptor's :COMPRESSION that REQUEST's
Accept-Encoding accepts first, or NIL."
  (let ((levels (reply-compression hunchentoot:*acceptor*)))
    (assoc (accepted-coding (hunchentoot:header-in :accept-encoding request) (mapcar #'car levels))
           levels)))

(defun mark-coded-reply (coding)
  "Set the headers of a reply coded with CODING: Content-Encoding, and its
entity tag made the coding's."
  (setf (hunchentoot:header-out :content-encoding) (string-downcase (symbol-name coding)))
  (let ((tag (hunchentoot:header-out :etag)))
    (when tag
      (setf (hunchentoot:header-out :etag) (coded-entity-tag tag coding)))))

(defun code-reply-body (request return-code body)
  "BODY (octets, or an ASCII string of REPLY-BODY's) as REQUEST's client
gets it: coded as its Accept-Encoding accepts when CODABLE-REPLY-P, the
headers set by MARK-CODED-REPLY, else BODY as it is."
  ;; Without codings, the reply's content type is not asked for.
  (if (not (and *serving*
                (serving-compression *serving*)
                (codable-reply-p hunchentoot:*acceptor* return-code (hunchentoot:content-type*) (length body))))
      body
      (let ((coding (reply-coding request)))
        (add-vary-accept-encoding)
        (if (null coding)
            body
            (progn (mark-coded-reply (car coding))
                   (coded-octets (car coding) (cdr coding)
                                 (if (stringp body) (ascii-string-octets body) body)))))))

(defvar *deciding-reply-coding* nil
  "True while CODE-STREAMED-REPLY looks at and sets the reply's headers,
which it reads through HUNCHENTOOT:HEADERS-OUT, whose method calls it.")

(defun code-streamed-reply (request)
  "When the reply whose head START-OUTPUT is about to send is streamed (its
length unknown: chunked) and could be coded, say it varies; when gzip is
among the acceptor's codings and REQUEST's client accepts it, mark it
coded and make the connection's stream one that gzips what the handler
writes (START-OUTPUT turns its chunking on), with this worker's gzip
stream.  Zstandard and Brotli code only replies whose octets are known."
  (let* ((acceptor hunchentoot:*acceptor*)
         (stream (current-connection-stream))
         (level (cdr (assoc :gzip (acceptor-compression acceptor)))))
    (when (and *serving* level
               (equal (hunchentoot:header-out :transfer-encoding) "chunked")
               (null (hunchentoot:header-out :content-encoding))
               ;; A request's own chunked body stream: its reply is sent as it is.
               (not (typep stream 'chunga:chunked-stream))
               (codable-reply-p acceptor (hunchentoot:return-code*) (hunchentoot:content-type*)
                                most-positive-fixnum))
      (add-vary-accept-encoding)
      (when (accepted-coding (hunchentoot:header-in :accept-encoding request) '(:gzip))
        (mark-coded-reply :gzip)
        (let ((gzip (gzip-stream-of (worker-coders) level)))
          (reset-gzip-stream gzip)
          (setf (current-connection-stream)
                (make-filtered-chunked-stream
                 stream (lambda (octets start end mode) (gzip-more-octets gzip octets start end mode)))))))))
